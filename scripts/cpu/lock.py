"""Write cpu-stack.txt: every package `make install` puts in the CPU venv, pinned, with hashes.

    make lock                                     # write the lock (this script, the venv's uv)
    python scripts/cpu/lock.py --torch-wheels W   # the same
    python scripts/cpu/lock.py --torch-wheels W --check   # exit 1 if resolving again differs
    python scripts/cpu/lock.py --torch-wheels W --same-date   # add a dependency, move nothing else

`make install` puts in torch from constraints-cpu.txt, then exactly this file (pip
--require-hashes --no-deps), then forgesky without dependencies, and runs pip check. The file is
`uv pip compile` of pyproject's base and launch, runtime, dev and peer extras (and pip) for
Python 3.11 on Linux x86_64, resolved with torch's CPU build (found in W, a folder or a page of
links: PyPI serves the CUDA build, which would add its CUDA libraries) and PyPI as of the moment
it is written (`--exclude-newer`, kept in the header so that --check resolves the same registry).

torch itself is left out: its wheel, and so its hash, depends on where it comes from (a CPU
index, a local wheel, PyPI's CUDA build with the CUDA libraries it pins). torchstore and verl
follow at the end, without their dependencies: their metadata pins a torch and a Monarch older
than ours (runtime/compat/torchstore.py) and verl's pulls its whole GPU stack; forgesky only
imports verl's loss functions to compare with its own (tests/test_losses.py).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "cpu-stack.txt"
CONSTRAINTS = ROOT / "constraints-cpu.txt"
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
# Every extra but gpu (vLLM, the nodes' stack: launcher/node-stack.txt).
EXTRAS = ("launch", "runtime", "dev", "peer")
# Installed without their dependencies (see the docstring).
WITHOUT_DEPS = ("torchstore==0.1.2", "verl==0.9.1")
DEFAULT_TORCH_WHEELS = "https://download.pytorch.org/whl/cpu/torch/"


def _uv(*args: str, stdin: str = "") -> str:
    out = subprocess.run(
        [sys.executable, "-m", "uv", *args], input=stdin, capture_output=True, text=True,
        cwd=ROOT, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"uv {args[0]} {args[1]} failed:\n{out.stderr}")
    return out.stdout


def _compile(*args: str, when: str, stdin: str = "") -> str:
    return _uv(
        "pip", "compile", *args,
        "--python-version", PYTHON_VERSION,
        "--python-platform", PLATFORM,
        "--only-binary", ":all:",
        "--exclude-newer", when,
        "--generate-hashes", "--no-header", "--quiet",
        stdin=stdin,
    )  # fmt: skip


def _without_torch(text: str) -> tuple[str, str]:
    """The compiled text less torch's entry, and that entry's pin."""
    lines, pin, skipping = [], "", False
    for line in text.splitlines(keepends=True):
        if not line.startswith(" "):
            skipping = line.startswith("torch==")
            if skipping:
                pin = line.split()[0]
        if not skipping:
            lines.append(line)
    return "".join(lines), pin


def _cuda_build_pins(when: str) -> list[str]:
    """The triton that PyPI's (CUDA) build of our torch pins.

    The CPU build asks for no triton and the runtime extra for any; locking the CUDA build's
    pin lets torch from either source leave the lock's versions as they are.
    """
    alone = _compile(
        "-", "--constraint", CONSTRAINTS.name, "--no-annotate", when=when, stdin="torch"
    )
    return [line.split()[0] for line in alone.splitlines() if line.startswith("triton==")]


def resolve(when: str, torch_wheels: str) -> str:
    """The lock's text for PyPI as of `when` (needs PyPI and torch's CPU wheels)."""
    extras = [a for extra in EXTRAS for a in ("--extra", extra)]
    stack = _compile(
        "pyproject.toml", "-", *extras,
        "--constraint", CONSTRAINTS.name,
        "--find-links", torch_wheels,
        when=when, stdin="\n".join(["pip", *_cuda_build_pins(when)]),
    )  # fmt: skip
    stack, torch = _without_torch(stack)
    if not torch.endswith("+cpu"):
        raise SystemExit(
            f"torch's CPU build is not in {torch_wheels} (resolved {torch or 'no torch'}): "
            "make lock TORCH_WHEELS=<a folder or page of links with its wheel>"
        )
    bare = _compile("-", "--no-deps", "--no-annotate", when=when, stdin="\n".join(WITHOUT_DEPS))
    uv = _uv("--version").split()[1]
    head = (
        f"# The CPU stack, for Python {PYTHON_VERSION} on {PLATFORM}. `make install` puts in torch\n"
        "# from constraints-cpu.txt (its wheel, and so its hash, differs by where it comes from: the\n"
        "# CPU build, or PyPI's CUDA build with its CUDA libraries), then exactly this file (pip\n"
        "# --require-hashes --no-deps), then forgesky itself, and runs pip check.\n"
        f"# Written by `make lock` (scripts/cpu/lock.py, uv {uv}) from pyproject.toml's base and\n"
        f"# {', '.join(EXTRAS)} extras, resolved with {torch} and PyPI as of\n"
        f"# {when}.\n"
    )
    tail = "\n# Without their dependencies (scripts/cpu/lock.py says why).\n"
    return head + stack + tail + bare


def locked_when(text: str) -> str:
    """The registry date a lock was resolved at, from its header."""
    found = re.search(r"PyPI as of\s+#?\s*(\S+)\.\n", text)
    if not found:
        raise SystemExit(f"{LOCK.name} has no 'PyPI as of' line in its header: run make lock")
    return found.group(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--torch-wheels", default=DEFAULT_TORCH_WHEELS,
        help=f"a folder or page of links holding torch's CPU wheels (default {DEFAULT_TORCH_WHEELS})",
    )  # fmt: skip
    parser.add_argument("--check", action="store_true", help="exit 1 if the lock is stale")
    parser.add_argument(
        "--same-date", action="store_true",
        help="resolve PyPI as of the lock's own date: a new dependency comes in, nothing else moves",
    )  # fmt: skip
    args = parser.parse_args()
    if args.check:
        current = LOCK.read_text() if LOCK.exists() else ""
        same = resolve(locked_when(current), args.torch_wheels) == current
        print(f"{LOCK.name} is {'up to date' if same else 'stale'}")
        return 0 if same else 1
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if args.same_date:
        now = locked_when(LOCK.read_text())
    text = resolve(now, args.torch_wheels)
    LOCK.write_text(text)
    pins = sum(1 for line in text.splitlines() if line[:1].isalnum())
    print(f"wrote {LOCK.name} ({pins} packages, PyPI as of {now})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
