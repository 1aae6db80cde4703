"""What the benches' runs share: a run started in a session of its own (so that its stop reaches
every process it starts) still ends with the bench that started it.

A device call cut at its time limit kills the bench, not the run's session: without this the run
goes on, holding the GPUs, and the call after it finds them taken (its vLLM engine then sees no
room for a KV cache). Linux's parent-death signal gives the run a SIGTERM when the bench is gone,
which the runtime takes as a Ctrl-C: it stops and shuts its procs down.
"""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ends_with_parent(sig: int = signal.SIGTERM) -> None:
    """`preexec_fn` of a `subprocess.Popen`: the child gets `sig` when the process that started
    it ends (a no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
