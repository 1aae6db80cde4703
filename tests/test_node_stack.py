"""The nodes install launcher/node-stack.txt exactly: it must be what resolving pyproject's
runtime requirements gives today (PyPI as of the day the stack was staged on the GPU machine,
that machine's image versions forced)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "node"))
import lock  # noqa: E402


def test_the_node_lock_is_in_step_with_pyproject():
    # resolves again with uv against PyPI (a package registry, as CI has)
    assert lock.resolve() == lock.LOCK.read_text(), "run: python scripts/node/lock.py"


def test_the_lock_pins_every_package_once_and_the_tested_versions():
    pins = [line for line in lock.LOCK.read_text().splitlines() if not line.startswith("#")]
    names = [line.split("==")[0] for line in pins]
    assert all("==" in line for line in pins) and len(names) == len(set(names))
    versions = dict(line.split("==") for line in pins)
    # what ran on the GPU machine: its image's transformers and the staged GPU stack
    assert versions["transformers"] == "5.17.0" and versions["torch"] == "2.11.0"
    assert versions["vllm"] == "0.24.0" and versions["torchmonarch"] == "0.7.0"
    # forgesky itself and torchstore (installed without dependencies) are not in it
    assert "forgesky" not in versions and "torchstore" not in versions


def test_the_lock_holds_the_cuda_libraries_torch_loads():
    # torch 2.11 reaches them through `cuda-toolkit[...]` extras, which an override of the
    # image's cuda-toolkit would drop (the set-up then fails: libcufile.so.0 missing)
    pins = lock.LOCK.read_text()
    for name in ("cufile", "cufft", "curand", "cusolver", "cusparse", "nvjitlink", "nvtx"):
        assert f"\nnvidia-{name}==" in pins, name
    for name in ("cuda-runtime", "cuda-nvrtc", "cuda-cupti", "cublas"):
        assert f"\nnvidia-{name}==" in pins, name
    overrides = lock.overrides()
    toolkit = next(o for o in overrides if o.startswith("cuda-toolkit"))
    assert toolkit.startswith("cuda-toolkit[") and "cufile" in toolkit, toolkit


def test_the_node_syncs_the_lock_with_the_uv_that_resolves_it_here():
    import tomllib
    from importlib.metadata import version

    from launcher.scripts import UV

    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert UV in dev["dev"]  # the uv the test above resolves with
    assert f"uv=={version('uv')}" == UV
