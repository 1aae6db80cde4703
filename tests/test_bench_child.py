"""A bench's run ends with the bench (bench/child.py): a run in a session of its own, whose bench
is killed with SIGKILL (a device call cut at its limit), gets SIGTERM and is gone; a bench
stopped with SIGTERM stops its run and goes on with the run's exit code."""

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


# The bench's part with run_child: SIGTERM to the bench (its call's time limit) stops the run and
# the bench goes on with the run's exit code, to summarize what the run recorded.
STOPPING = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from child import run_child
    child = (
        "import os, signal, sys, time\\n"
        "def stop(*_):\\n"
        "    print('stopping', flush=True)\\n"
        "    sys.exit(7)\\n"
        "signal.signal(signal.SIGTERM, stop)\\n"
        "print(os.getpid(), flush=True)\\n"
        "time.sleep(120)\\n"
    )
    log = Path(sys.argv[2])
    code = run_child([sys.executable, "-u", "-c", child], log, Path.cwd(), grace_s=20)
    print("bench goes on; run exit", code, flush=True)
    """
)


def test_a_stopped_bench_stops_its_run_and_goes_on_with_its_exit_code(tmp_path):
    log = tmp_path / "run.log"
    bench = subprocess.Popen(
        [sys.executable, "-c", STOPPING, str(ROOT / "bench"), str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (log.exists() and log.read_text().strip()):
        time.sleep(0.05)
    pid = int(log.read_text().split()[0])  # the run said its pid
    assert os.getsid(pid) == pid
    bench.send_signal(signal.SIGTERM)
    out, _ = bench.communicate(timeout=30)
    assert bench.returncode == 0
    assert out.strip() == "bench goes on; run exit 7"
    assert log.read_text().split()[1:] == ["stopping"]
