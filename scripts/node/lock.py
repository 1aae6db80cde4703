"""Write launcher/node-stack.txt: every package a node installs, pinned to what was tested.

    python scripts/node/lock.py            # write the lock
    python scripts/node/lock.py --check    # exit 1 if the lock is not what resolving gives now

The nodes' set-up installs exactly this file (`uv pip sync`), then forgesky and torchstore
without dependencies (launcher/scripts.py). It is `uv pip compile` of the runtime's
requirements (pyproject's base and `runtime` extra, the pinned GPU stack) for the nodes'
platform, with every package the GPU machine's image had forced to the image's version
(scripts/node/gpu-image-packages.txt, `--override`: the stack was tested on that image with its
own versions, vLLM's wheels added beside them), and PyPI as it was on the day the stack was
staged there (`--exclude-newer`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launcher.scripts import NODE_PLATFORM, PYTHON_VERSION, RUNTIME_STACK  # noqa: E402

LOCK = ROOT / "launcher" / "node-stack.txt"
IMAGE = ROOT / "scripts" / "node" / "gpu-image-packages.txt"
# The day the stack was staged on the GPU machine (scripts/gpu/prepare_wheels.sh).
STAGED_ON = "2026-11-21"
# An override replaces every requirement of its name whole, extras included: torch 2.11 asks
# for `cuda-toolkit[...]==13.0.2`, whose extras are the CUDA libraries it loads (libcufile and
# the rest); overriding plain `cuda-toolkit==13.0.2` would drop them from the lock and leave a
# torch that cannot import. The overrides keep these extras.
OVERRIDE_EXTRAS = {
    "cuda-toolkit": "cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx",
}


def requirements() -> list[str]:
    """pyproject's base dependencies and runtime extra, with the GPU stack's pins."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {r.split("==")[0] for r in RUNTIME_STACK}
    wanted = [*project["dependencies"], *project["optional-dependencies"]["runtime"]]
    loose = [r for r in wanted if _name(r) not in pinned]
    return [*RUNTIME_STACK, *loose]


def _name(requirement: str) -> str:
    for mark in "<>=!~[ ;":
        requirement = requirement.split(mark)[0]
    return requirement.strip().lower()


def overrides() -> list[str]:
    """The image's versions, with the extras its requirers ask for (OVERRIDE_EXTRAS)."""
    out = []
    for line in IMAGE.read_text().split():
        name, _, version = line.partition("==")
        extras = OVERRIDE_EXTRAS.get(name.lower())
        out.append(f"{name}[{extras}]=={version}" if extras else line)
    return out


def resolve() -> str:
    """The lock's text, from `uv pip compile` (needs PyPI)."""
    with tempfile.TemporaryDirectory() as tmp:
        wanted = Path(tmp) / "requirements.in"
        wanted.write_text("\n".join(requirements()) + "\n")
        image = Path(tmp) / "overrides.txt"
        image.write_text("\n".join(overrides()) + "\n")
        out = subprocess.run(
            [
                sys.executable, "-m", "uv", "pip", "compile", str(wanted),
                "--python-version", PYTHON_VERSION,
                "--python-platform", NODE_PLATFORM,
                "--only-binary", ":all:",
                "--override", str(image),
                "--exclude-newer", STAGED_ON,
                "--no-header", "--no-annotate", "--quiet",
            ],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"uv pip compile failed:\n{out.stderr}")
    head = (
        f"# The packages every node installs (uv pip sync), for Python {PYTHON_VERSION} on "
        f"{NODE_PLATFORM}.\n"
        "# Written by `python scripts/node/lock.py` from pyproject.toml's runtime requirements and\n"
        f"# the GPU stack; the GPU machine's image versions forced; PyPI as of {STAGED_ON}.\n"
    )
    return head + out.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the lock is stale")
    args = parser.parse_args()
    text = resolve()
    if args.check:
        same = LOCK.exists() and LOCK.read_text() == text
        print(f"{LOCK.relative_to(ROOT)} is {'up to date' if same else 'stale'}")
        return 0 if same else 1
    LOCK.write_text(text)
    print(f"wrote {LOCK.relative_to(ROOT)} ({text.count(chr(10)) - 3} packages)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
