"""How the project's own code reaches a node: a synced checkout, a mounted wheel, or a release.

`forgesky` runs from one of three installs, and the task follows it:

- a checkout (a clone, also when installed editable): the folder is SkyPilot's workdir, synced
  to every node, and the set-up installs it editable (`-e '.[runtime]'`);
- a wheel file (`pip install forgesky-X-py3-none-any.whl`, possibly your own build): the same
  file is file-mounted on every node and the set-up installs exactly it;
- a package index (`pip install forgesky`): the set-up installs the same version from the index.

An installed forgesky never makes site-packages the workdir: that would sync every package of
the local environment to the nodes, and an editable install of it cannot work there.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from launcher.scripts import CHECKOUT_REQUIREMENT, LOCK_MOUNT
from recipes import UserError

DISTRIBUTION = "forgesky"
# Where a wheel is mounted on the nodes.
WHEEL_MOUNT_DIR = "/forgesky/dist"


@dataclass(frozen=True)
class ProjectSource:
    """What the task needs to bring forgesky to a node."""

    # "checkout", "wheel" or "release"
    kind: str
    # The argument that names forgesky in the set-up's `uv pip install` (shell-quoted).
    requirement: str
    # Local folder synced as SkyPilot's workdir (checkouts only).
    workdir: str | None = None
    # remote path -> local path: the node-stack lock, and the wheel
    mounts: dict[str, str] = field(default_factory=dict)
    # One line for people: what reaches the nodes.
    summary: str = ""


# The lock of the nodes' packages, in this install of forgesky (checkout, wheel or index).
LOCK_FILE = Path(__file__).resolve().parent / "node-stack.txt"


def checkout(folder: str) -> ProjectSource:
    """A source tree: synced as the workdir, installed editable on the node."""
    return ProjectSource(
        kind="checkout",
        requirement=CHECKOUT_REQUIREMENT,
        workdir=folder,
        mounts={LOCK_MOUNT: f"{folder}/launcher/node-stack.txt"},
        summary=f"the checkout {folder}, synced to every node and installed there editable",
    )


def wheel(path: Path) -> ProjectSource:
    """A wheel file: mounted on every node, installed there."""
    remote = f"{WHEEL_MOUNT_DIR}/{path.name}"
    return ProjectSource(
        kind="wheel",
        requirement=f"'{DISTRIBUTION}[runtime] @ file://{remote}'",
        mounts={LOCK_MOUNT: str(LOCK_FILE), remote: str(path)},
        summary=f"the wheel {path}, mounted on every node and installed there",
    )


def release(version: str) -> ProjectSource:
    """The same version from the package index."""
    return ProjectSource(
        kind="release",
        requirement=f"'{DISTRIBUTION}[runtime]=={version}'",
        mounts={LOCK_MOUNT: str(LOCK_FILE)},
        summary=f"{DISTRIBUTION} {version} from the package index, installed on every node",
    )


def is_checkout(folder: Path) -> bool:
    """A source tree of this project (not site-packages): pyproject.toml naming forgesky."""
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file():
        return False
    try:
        text = pyproject.read_text()
    except OSError:
        return False
    return f'name = "{DISTRIBUTION}"' in text and (folder / "launcher").is_dir()


def _local_path(url: str) -> Path | None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "file":
        return None
    return Path(urllib.request.url2pathname(parsed.path))


def installed_source(dist: metadata.Distribution) -> ProjectSource:
    """From an installed distribution's PEP 610 record (direct_url.json) to its source."""
    text = dist.read_text("direct_url.json")
    version = dist.version
    if not text:
        # From an index: no direct URL recorded.
        return release(version)
    try:
        direct = json.loads(text)
    except ValueError:
        return release(version)
    url = str(direct.get("url", ""))
    local = _local_path(url)
    if local is None:
        # A VCS or remote archive URL: the same version from the index is what the user has.
        return release(version)
    if "dir_info" in direct:
        if is_checkout(local):
            return checkout(str(local))
        raise UserError(
            f"{DISTRIBUTION} was installed from the folder {local}, which is no longer a "
            f"{DISTRIBUTION} source tree; install it again (pip install PATH_TO_CHECKOUT or a wheel)"
        )
    if local.suffix == ".whl":
        if local.is_file():
            return wheel(local)
        raise UserError(
            f"{DISTRIBUTION} was installed from {local}, which is gone, and the nodes install "
            f"that same wheel; put it back there or install {DISTRIBUTION} again from a wheel "
            "you keep"
        )
    # An sdist or other archive installed from a local file: fall back to the index.
    return release(version)


def project_source(project_dir: Path) -> ProjectSource:
    """The source of the forgesky that is running, whose code lives in `project_dir`."""
    if is_checkout(project_dir):
        return checkout(str(project_dir))
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise UserError(
            f"{DISTRIBUTION} runs from {project_dir}, which is neither a checkout nor an "
            "installed package; install it (pip install forgesky, or a wheel) to launch"
        ) from None
    return installed_source(dist)
