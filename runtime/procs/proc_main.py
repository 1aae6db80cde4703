"""What every service proc runs first: `python -m runtime.procs.proc_main` (ServiceMesh.spawn
starts procs with it). It makes the proc print its stacks on `kill -USR1`
(`runtime.procs.host.stacks_on_signal`, which must run before any other thread starts), then
hands the process to Monarch's own proc main."""

from __future__ import annotations

import runpy

from runtime.procs.host import stacks_on_signal

if __name__ == "__main__":
    stacks_on_signal()
    runpy.run_module("monarch._src.actor.bootstrap_main", run_name="__main__", alter_sys=True)
