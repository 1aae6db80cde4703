"""Separate hosts on one machine: Linux network namespaces joined by a bridge.

    with Fabric(3) as fabric:            # nodes 10.200.0.1, .2, .3, each in its own namespace
        fabric.run(1, ["python", ...])   # a process on node 1's network only
        fabric.cut(2)                    # node 2's cable pulled and its processes killed

The bridge lives in a namespace of its own, so nothing here touches the machine's own network
and concurrent fabrics cannot clash. Needs root (CAP_SYS_ADMIN) and iproute2's `ip`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence

SUBNET = "10.200.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"fskprobe{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


class Fabric:
    """`nodes` network namespaces on one bridge, node i at 10.200.0.(i+1)."""

    def __init__(self, nodes: int) -> None:
        tag = uuid.uuid4().hex[:8]
        self.bridge_ns = f"fsk{tag}-br"
        self.names = [f"fsk{tag}-n{i}" for i in range(nodes)]
        self.ips = [f"{SUBNET}.{i + 1}" for i in range(nodes)]

    def __enter__(self) -> Fabric:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, (name, ip) in enumerate(zip(self.names, self.ips, strict=True)):
            _ip("netns", "add", name)
            port = f"v{i}"
            _ip(
                "link",
                "add",
                port,
                "netns",
                self.bridge_ns,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                name,
            )
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def run(self, node: int, argv: Sequence[str], **popen: object) -> subprocess.Popen:
        """Start `argv` inside node `node`'s namespace, in a session of its own."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[node], *argv], start_new_session=True, **popen
        )

    def pids(self, node: int) -> list[int]:
        """Processes whose network is node `node`'s."""
        out = _ip("netns", "pids", self.names[node], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, node: int) -> None:
        """SIGKILL every process on node `node`."""
        for pid in self.pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def cut(self, node: int) -> None:
        """The node dies: its link goes down first (so no connection is closed cleanly),
        then its processes are killed."""
        _ip("-n", self.names[node], "link", "set", "eth0", "down", check=False)
        self.kill(node)

    def close(self) -> None:
        for node, name in enumerate(self.names):
            self.kill(node)
            _ip("netns", "del", name, check=False)
        _ip("netns", "del", self.bridge_ns, check=False)
