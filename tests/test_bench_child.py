"""A bench's run ends with the bench (bench/child.py): a run in a session of its own, whose bench
is killed with SIGKILL (a device call cut at its limit), gets SIGTERM and is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from runtime_helpers import ROOT

# The bench's part: a child in a session of its own, as gpu_tools.py and gpu_sft.py start runs;
# the child says its pid, then sleeps; SIGTERM ends it with a line in its file (written
# whole, then renamed: the test reads it once it exists)
PARENT = textwrap.dedent(
    """
    import subprocess, sys
    sys.path.insert(0, sys.argv[1])
    from child import ends_with_parent
    child = (
        "import os, signal, sys, time\\n"
        "def stop(*_):\\n"
        "    open(sys.argv[1] + '.tmp', 'w').write('stopped by SIGTERM')\\n"
        "    os.replace(sys.argv[1] + '.tmp', sys.argv[1])\\n"
        "    sys.exit(0)\\n"
        "signal.signal(signal.SIGTERM, stop)\\n"
        "print(os.getpid(), flush=True)\\n"
        "time.sleep(120)\\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, sys.argv[2]], stdout=sys.stdout,
                            start_new_session=True, preexec_fn=ends_with_parent)
    proc.wait()
    """
)


def test_a_run_in_its_own_session_gets_sigterm_when_its_bench_is_killed(tmp_path):
    said = tmp_path / "said"
    bench = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(ROOT / "bench"), str(said)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert bench.stdout is not None
    pid = int(bench.stdout.readline())
    assert os.getsid(pid) == pid  # its own session: a kill of the bench's group misses it
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not said.exists():
        time.sleep(0.05)
    assert said.read_text() == "stopped by SIGTERM"
