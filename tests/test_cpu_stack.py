"""`make install` installs cpu-stack.txt exactly: the lock must hold what pyproject asks for,
every pin hashed, and the venv the tests run in must be that lock (torch and forgesky aside)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# by its path: tests/test_node_stack.py imports the nodes' lock.py as `lock`
_spec = importlib.util.spec_from_file_location("cpu_lock", ROOT / "scripts" / "cpu" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def entries() -> dict[str, tuple[str, list[str]]]:
    """The lock's packages: name -> (version, hashes)."""
    out: dict[str, tuple[str, list[str]]] = {}
    name = ""
    for line in lock.LOCK.read_text().splitlines():
        pin = PIN.match(line)
        if pin:
            name = canonicalize_name(pin.group(1))
            assert name not in out, f"{name} pinned twice"
            out[name] = (pin.group(2), [])
        elif line.strip().startswith("--hash=sha256:"):
            out[name][1].append(line.strip())
    return out


def test_every_requirement_of_pyproject_is_locked_at_a_version_it_accepts():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    # the lock covers every extra but the GPU one (vLLM, in the nodes' own lock)
    assert set(extras) - set(lock.EXTRAS) == {"gpu"}
    pins = entries()
    torch = Version((ROOT / "constraints-cpu.txt").read_text().split("torch==")[1].split()[0])
    wanted = [*project["dependencies"], *(r for e in lock.EXTRAS for r in extras[e])]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "torch":  # installed after the lock, from constraints-cpu.txt
            assert torch in req.specifier, (text, torch)
            continue
        assert name in pins, f"{text} is not in {lock.LOCK.name}: run make lock"
        assert Version(pins[name][0]) in req.specifier, f"{text} vs {pins[name][0]}: run make lock"


def test_every_pin_is_hashed_and_torch_and_forgesky_are_left_out():
    pins = entries()
    assert all(hashes for _, hashes in pins.values()), [n for n, (_, h) in pins.items() if not h]
    assert "torch" not in pins and "forgesky" not in pins
    for text in lock.WITHOUT_DEPS:
        name, version = text.split("==")
        assert pins[name][0] == version
    # resolved with torch's CPU build: its CUDA libraries come with the CUDA build, if at all
    assert not any(n.startswith(("nvidia-", "cuda-")) for n in pins)
    assert re.search(r"resolved with torch==\S+\+cpu ", lock.LOCK.read_text())


def test_the_venv_holds_the_lock_exactly():
    # what make install built (the tests run in it); a stale venv: make install rebuilds it
    wrong = {}
    for name, (version, _) in entries().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "missing"
        if installed == "missing" or Version(installed) != Version(version):
            wrong[name] = (version, installed)
    assert not wrong, f"locked vs installed: {wrong}"


def test_make_install_refuses_a_python_the_lock_is_not_for(tmp_path):
    header = lock.LOCK.read_text().splitlines()[0]
    assert f" for Python {lock.PYTHON_VERSION} on " in header
    other = tmp_path / "python"
    other.write_text("#!/bin/sh\necho 3.99\n")
    other.chmod(0o755)
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    out = subprocess.run(
        ["make", "install", f"PYTHON={other}", f"VENV={venv}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and not out.stdout and not venv.exists()
    assert out.stderr.count("\n") == 1, out.stderr
    assert f"locked for Python {lock.PYTHON_VERSION} but {other} is Python 3.99" in out.stderr
