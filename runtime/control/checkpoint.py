"""Atomic checkpoint directories: write, flush, commit; resume from the newest committed one.

Layout under the checkpoint dir:

    step_000050/            a committed checkpoint (holds COMMITTED, written last)
    step_000100.partial/    being written, or cut off by a crash: never read

A checkpoint is written into `<name>.partial/`, every file is fsynced, the directory is renamed to
its final name and only then the COMMITTED marker is written and fsynced. A reader trusts a
directory only if the marker is there, so a bucket mounted with MOUNT_CACHED (which uploads files
asynchronously and may upload the marker before a rename is visible) never yields a partial one:
the marker is the last file written. Uploads need not finish in that order, though, and a node
that goes away loses what it had not uploaded: the marker lists every file's size, and a
checkpoint whose files do not match is skipped for the newest one that does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from recipes import UserError
from recipes.names import KEPT_CHECKPOINTS

MARKER = "COMMITTED"
_NAME = re.compile(r"^step_(\d{6,})$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def begin(root: Path, step: int) -> Path:
    """A fresh `.partial` directory to write checkpoint `step` into."""
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f"{step_dir_name(step)}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    return partial


def commit(root: Path, partial: Path, step: int, keep: int = KEPT_CHECKPOINTS) -> Checkpoint:
    """Flush `partial`, rename it to its final name, write the marker; keep the last `keep`."""
    for f in sorted(partial.rglob("*")):
        if f.is_file():
            _fsync_path(f)
    _fsync_path(partial)
    final = root / step_dir_name(step)
    if final.exists():
        # marker first: a crash mid-delete leaves an ignored directory, never a damaged one
        (final / MARKER).unlink(missing_ok=True)
        shutil.rmtree(final)
    os.rename(partial, final)
    _fsync_path(root)
    files = {
        str(f.relative_to(final)): f.stat().st_size for f in sorted(final.rglob("*")) if f.is_file()
    }
    marker = final / MARKER
    with open(marker, "w") as fh:
        json.dump({"step": step, "files": files}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_path(final)
    prune(root, keep)
    return Checkpoint(step, final)


def committed(root: Path) -> list[Checkpoint]:
    """Committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and d.is_dir() and (d / MARKER).is_file():
            found.append(Checkpoint(int(m.group(1)), d))
    return sorted(found, key=lambda c: c.step)


def _damage(ckpt: Checkpoint) -> str | None:
    """What is wrong with a committed checkpoint's files against its marker (None: nothing)."""
    try:
        marker = json.loads((ckpt.path / MARKER).read_text())
        marked, files = marker["step"], marker["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{ckpt.path / MARKER}: unreadable checkpoint marker ({e})"
    if marked != ckpt.step:
        return (
            f"{ckpt.path / MARKER}: marker says step {marked} but the directory is step {ckpt.step}"
        )
    for rel, size in files.items():
        f = ckpt.path / rel
        actual = f.stat().st_size if f.is_file() else None
        if actual != size:
            what = "missing" if actual is None else f"{actual} bytes, expected {size}"
            return f"{f}: checkpoint file is cut short or damaged ({what})"
    return None


RESUME_ADVICE = "delete that checkpoint directory to resume from an earlier one"


def verify(ckpt: Checkpoint, advice: str = RESUME_ADVICE) -> None:
    """Check the marker against the files on disk; a mismatch is a UserError naming the file."""
    damage = _damage(ckpt)
    if damage is not None:
        raise UserError(f"{damage}; {advice}")


def latest(root: Path, advice: str = RESUME_ADVICE) -> Checkpoint | None:
    """The newest committed checkpoint whose files match its marker.

    A newer one that does not match is skipped with a warning: on a bucket mounted with
    MOUNT_CACHED, a node that went away may have uploaded a marker but not every file. If no
    committed checkpoint matches, that is a UserError naming the newest.
    """
    ckpts = committed(root)
    skipped = []
    for ckpt in reversed(ckpts):
        damage = _damage(ckpt)
        if damage is None:
            for name, why in skipped:  # said only where an older one is taken instead
                print(f"forgesky: warning: skipping checkpoint {name}: {why}", file=sys.stderr)
            return ckpt
        skipped.append((ckpt.path.name, damage))
    if ckpts:
        verify(ckpts[-1], advice)  # none is whole: one line about the newest
    return None


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` committed checkpoints and any stale `.partial` dirs."""
    ckpts = committed(root)
    for old in ckpts[: max(0, len(ckpts) - keep)]:
        # drop the marker first so a crash mid-delete leaves an uncommitted, ignored dir
        (old.path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(old.path, ignore_errors=True)
    newest = ckpts[-1].step if ckpts else -1
    for d in root.glob("step_*.partial"):
        m = re.match(r"^step_(\d+)\.partial$", d.name)
        if m and int(m.group(1)) <= newest:
            shutil.rmtree(d, ignore_errors=True)


def free_bytes(root: Path) -> int | None:
    """Bytes this user may still write on the filesystem that holds `root` (or would hold it:
    its nearest existing parent); None where the filesystem gives no size (some bucket mounts
    report 0 blocks), so that nothing is refused on a number that means nothing."""
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize


def make_room(root: Path, need: float) -> tuple[int | None, list[Checkpoint]]:
    """Called with no write in flight: delete what is left of cut-off writes (`.partial`
    folders), then committed checkpoints older than the newest, oldest first, until `need`
    bytes are free under `root` (the newest, which a resume reads, is never deleted); the bytes
    free after and the committed checkpoints deleted."""
    free = free_bytes(root)
    if free is not None and free < need and root.is_dir():
        for partial in root.glob("step_*.partial"):
            shutil.rmtree(partial, ignore_errors=True)
        free = free_bytes(root)
    deleted: list[Checkpoint] = []
    for old in committed(root)[:-1]:
        if free is None or free >= need:
            break
        (old.path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(old.path, ignore_errors=True)
        deleted.append(old)
        free = free_bytes(root)
    return free, deleted


def room(root: Path) -> int | None:
    """Bytes the next checkpoint under `root` may fill: what is free, and what `make_room`
    would free (cut-off writes, every committed checkpoint but the newest); None where the
    filesystem gives no size."""
    free = free_bytes(root)
    if free is None:
        return None
    cut_off = sum(bytes_under(p) for p in root.glob("step_*.partial")) if root.is_dir() else 0
    return free + cut_off + sum(bytes_under(c.path) for c in committed(root)[:-1])


def approx_size(nbytes: float) -> str:
    """`~21 GB`, `~3.4 GB`, `~12 MB`: a size for a progress line."""
    if nbytes >= 10e9:
        return f"~{nbytes / 1e9:.0f} GB"
    if nbytes >= 1e9:
        return f"~{nbytes / 1e9:.1f} GB"
    mb = max(nbytes / 1e6, 0.1)
    return f"~{mb:.0f} MB" if mb >= 10 else f"~{mb:.1f} MB"


def marked_bytes(ckpt: Checkpoint) -> int:
    """The size of a committed checkpoint's files, as its marker lists them."""
    return sum(json.loads((ckpt.path / MARKER).read_text())["files"].values())


def bytes_under(folder: Path) -> int:
    """The size of every file under `folder` so far (0 while it does not exist): a checkpoint
    being written, which has no marker yet."""
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:  # a file renamed or removed meanwhile
            continue
    return total
