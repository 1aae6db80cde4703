"""Local files and folders a recipe names (data, held-out data, a model or tokenizer folder),
and model folders in a bucket, brought to the nodes as SkyPilot file mounts, and the node paths
the run reads them at.

Each lands under FILES_MOUNT_DIR/<setting>/<its name> (e.g.
/forgesky/files/dataset.path/train.jsonl): one folder per setting, so two settings never
claim one node path, and a file keeps its name (its suffix says how to read it). Two settings
naming the same file or folder share one mount. The node is pointed there by `--set` overrides
(model.hf_id by $MODEL), so the recipe stays the one source of what the run reads.

A cluster (`sky launch`) gets the files by rsync to every node; a managed job's are uploaded by
SkyPilot to its jobs bucket (one it makes for the job, or `jobs.bucket` in ~/.sky/config.yaml)
and copied from there on every (re)start. SkyPilot sets no size limit on either. What SkyPilot
cannot bring is refused here, before launch: a path that is missing, unreadable, not a regular
file or folder, or a folder holding links (rsync copies them as links, which dangle on a node).

A model or tokenizer folder in a bucket (`s3://me/ckpt/sft-qwen3-1.7b-sft/model`, an SFT run's
export) is a file mount whose source is the bucket URL: SkyPilot copies it to every node when
the cluster starts (and a managed job's on every restart), with the store's own tool (`aws s3
sync`, ...), so vLLM and the trainer read local files. The URL's form is checked by the recipe
(recipes/buckets.py); what the bucket holds is not looked at here (no network), SkyPilot finds
out at launch.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes import UserError
from recipes.buckets import bucket_leaf, bucket_source
from recipes.files import (
    DATA_FIELDS,
    DATA_FILE_FORMATS,
    bucket_reads,
    local_path,
    missing_path,
    read_paths,
)

# The repository's root: a task runs from there (its workdir).
REPOSITORY = Path(__file__).resolve().parent.parent

# Node folder under which local files are mounted, one sub-folder per setting.
FILES_MOUNT_DIR = "/forgesky/files"


@dataclass(frozen=True)
class LocalFile:
    """A setting's local file or folder and where the nodes see it."""

    field: str  # e.g. "dataset.path"
    value: str  # as the recipe (or --set) gives it
    local: Path  # on this machine, resolved (links followed: SkyPilot copies no link targets)
    remote: str  # on the nodes
    size: int  # bytes

    @property
    def source(self) -> str:
        """The path a task file names: inside the repository (data shipped with forgesky, say)
        relative to its root, as `./...` (tasks run from there, and the file stays the same on
        every machine); elsewhere the absolute path."""
        try:
            return f"./{self.local.relative_to(REPOSITORY)}"
        except ValueError:
            return str(self.local)


def local_files(recipe: Any) -> tuple[LocalFile, ...]:
    """The local files and folders a run of `recipe` reads, each checked and given its node
    path; raises UserError (one line) for the first that cannot reach the nodes."""
    found: list[LocalFile] = []
    for setting in read_paths(recipe):
        path = local_path(setting.value)
        if path is None:
            continue
        where = f"{setting.field} {setting.value!r}"
        # the name as given (a link's, not its target's): its suffix tells the loader the format
        name = Path(os.path.abspath(path)).name
        local, size = _check(where, path, name, data=setting.field in DATA_FIELDS)
        same = next((f for f in found if f.local == local), None)
        remote = same.remote if same else f"{FILES_MOUNT_DIR}/{setting.field}/{name}"
        found.append(LocalFile(setting.field, setting.value, local, remote, size))
    return tuple(found)


@dataclass(frozen=True)
class BucketFile:
    """A setting's folder in a bucket and where the nodes see it."""

    field: str  # e.g. "model.hf_id"
    value: str  # the bucket URL, as the recipe (or --set) gives it
    remote: str  # on the nodes

    @property
    def source(self) -> str:
        """The file mount's source: the URL without a trailing slash."""
        return bucket_source(self.value)


def bucket_files(recipe: Any) -> tuple[BucketFile, ...]:
    """The model and tokenizer folders in a bucket that a run of `recipe` reads, each given its
    node path (two settings naming one folder share it)."""
    found: list[BucketFile] = []
    for setting in bucket_reads(recipe):
        source = bucket_source(setting.value)
        same = next((f for f in found if f.source == source), None)
        remote = same.remote if same else f"{FILES_MOUNT_DIR}/{setting.field}/{bucket_leaf(source)}"
        found.append(BucketFile(setting.field, setting.value, remote))
    return tuple(found)


def describe(files: tuple[LocalFile | BucketFile, ...], *, sizes: bool = True) -> list[str]:
    """One line a file for people: the setting, the local path (its size) or the bucket URL,
    the node path."""
    return [
        f"{f.field} {f.source}"
        + (" (copied from the bucket)" if isinstance(f, BucketFile) else "")
        + (f" ({_size(f.size)})" if sizes and isinstance(f, LocalFile) else "")
        + f" -> {f.remote}"
        for f in files
    ]


def _check(where: str, path: Path, name: str, *, data: bool) -> tuple[Path, int]:
    """The resolved path and its size in bytes, or UserError saying why it cannot be mounted
    (or read on the node: a data file's format goes by the suffix of `name`, a model or
    tokenizer is a folder)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise UserError(missing_path(where, path)) from None
    except OSError as e:
        raise UserError(f"{where}: cannot be read ({e.strerror})") from None
    local = path.resolve()
    if not name or local == Path(local.anchor):
        raise UserError(f"{where}: the root folder cannot be copied to the nodes; name a folder")
    if stat.S_ISREG(info.st_mode):
        if not data:
            raise UserError(
                f"{where}: a file; name the model's folder (its config.json, tokenizer and "
                "*.safetensors files)"
            )
        if Path(name).suffix not in DATA_FILE_FORMATS:
            raise UserError(
                f"{where}: unsupported file type; use {', '.join(DATA_FILE_FORMATS)} "
                "(or a folder written by datasets' save_to_disk)"
            )
        _readable(where, local)
        return local, info.st_size
    if stat.S_ISDIR(info.st_mode):
        return local, _folder_size(where, local)
    raise UserError(
        f"{where}: not a regular file or folder, which cannot be copied to the nodes; "
        "name a file or folder"
    )


def _readable(where: str, file: Path) -> None:
    try:
        with open(file, "rb"):
            pass
    except OSError as e:
        raise UserError(
            f"{where}: {file} cannot be read ({e.strerror}); make it readable (chmod +r) "
            "or name a copy that is"
        ) from None


def _folder_size(where: str, folder: Path) -> int:
    """Bytes of every file in `folder`, each checked as SkyPilot's copy would need it."""
    total = 0
    pending = [folder]
    while pending:
        current = pending.pop()
        try:
            entries = list(os.scandir(current))
        except OSError as e:
            raise UserError(
                f"{where}: the folder {current} cannot be read ({e.strerror}); make it readable "
                "(chmod -R +rX) or name a copy that is"
            ) from None
        for entry in entries:
            inside = Path(entry.path)
            if entry.is_symlink():
                raise UserError(
                    f"{where}: {inside} is a link, which reaches the nodes as a link and not the "
                    "file it points to; copy the folder with links followed (cp -rL) and name "
                    "the copy"
                )
            if entry.is_dir():
                pending.append(inside)
            elif entry.is_file():
                _readable(where, inside)
                total += entry.stat().st_size
            else:
                raise UserError(
                    f"{where}: {inside} is not a regular file or folder, which cannot be copied "
                    "to the nodes; remove it or name a folder without it"
                )
    return total


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
