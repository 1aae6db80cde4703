"""The Python tool's sandbox (runtime/environments/sandbox.py) with real processes: CPU seconds,
memory, wall time, no network, writes only in its temporary folder; and builtin:python, the
OpenEnv environment around it."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest

from runtime.environments import sandbox
from runtime.environments.sandbox import Limits, SandboxUnavailable, check, run_python

LIMITS = Limits(cpu_seconds=1, memory_mb=256, wall_seconds=20)
ISOLATED = pytest.mark.skipif(
    sandbox.namespaces_error() is not None,
    reason=f"user namespaces are not permitted here: {sandbox.namespaces_error()}",
)


@pytest.fixture(params=["namespaces", "rlimits"])
def limits(request):
    if request.param == "namespaces" and sandbox.namespaces_error() is not None:
        pytest.skip(f"user namespaces are not permitted here: {sandbox.namespaces_error()}")
    return Limits(cpu_seconds=1, memory_mb=256, wall_seconds=20, isolation=request.param)


def test_the_code_runs_and_its_output_comes_back(limits):
    out = run_python("import math\nprint(math.factorial(10))", limits)
    assert (out.output, out.returncode, out.stopped) == ("3628800\n", 0, None)


def test_an_exception_is_its_traceback_in_the_output(limits):
    out = run_python("x = 1\nx / 0\n", limits)
    assert out.returncode == 1 and out.stopped is None
    assert 'File "code.py", line 2' in out.output and "ZeroDivisionError" in out.output
    assert "runpy" not in out.output  # the sandbox's own frames are left out


def test_cpu_seconds_are_capped(limits):
    out = run_python("while True:\n    pass\n", limits)
    assert out.stopped == "cpu" and out.returncode != 0


def test_memory_is_capped(limits):
    out = run_python("block = bytearray(1024 * 2**20)\nprint('allocated')", limits)
    assert out.stopped == "memory" and "allocated" not in out.output


def test_the_wall_time_kills_code_that_waits(limits):
    quick = Limits(cpu_seconds=5, memory_mb=256, wall_seconds=1, isolation=limits.isolation)
    out = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", quick)
    assert out.stopped == "wall" and out.output.startswith("start")


def test_output_is_cut_to_the_limit(limits):
    short = Limits(output_chars=100, isolation=limits.isolation)
    out = run_python("print('x' * 5000)", short)
    assert out.output.startswith("x" * 100) and "more characters" in out.output


@ISOLATED
def test_the_network_is_cut():
    """A server listening on this machine's loopback is out of the code's reach."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\nprint('reached')"
    try:
        jailed = run_python(code, LIMITS)
        # the same code outside the namespaces reaches it: the isolation is what stops it
        free = run_python(code, Limits(isolation="rlimits"))
    finally:
        server.close()
    assert "reached" not in jailed.output and "Error" in jailed.output
    assert free.output == "reached\n"


@ISOLATED
def test_writes_go_only_to_the_temporary_folder(tmp_path):
    outside = tmp_path / "outside.txt"
    code = (
        "open('mine.txt', 'w').write('kept here')\n"
        "print(open('mine.txt').read())\n"
        f"open({str(outside)!r}, 'w').write('escaped')\n"
    )
    out = run_python(code, LIMITS)
    assert out.output.startswith("kept here\n")
    assert "Read-only file system" in out.output and not outside.exists()


def test_without_user_namespaces_the_sandbox_refuses_unless_the_recipe_says_rlimits(monkeypatch):
    monkeypatch.setattr(sandbox, "namespaces_error", lambda: "unshare --user failed: EPERM")
    with pytest.raises(SandboxUnavailable) as e:
        check(Limits())
    assert "\n" not in str(e.value)
    assert "user namespaces are not permitted here" in str(e.value)
    assert "env.sandbox.isolation=rlimits" in str(e.value)
    with pytest.raises(SandboxUnavailable):
        run_python("print(1)", Limits())
    assert "NOT isolated" in check(Limits(isolation="rlimits"))
    assert run_python("print(1)", Limits(isolation="rlimits")).output == "1\n"


def test_builtin_python_runs_the_models_code_and_scores_the_final_answer(limits):
    from runtime.environments.api import ToolCall
    from runtime.environments.host import Spec
    from runtime.environments.local import LocalEnvironments

    spec = Spec("runtime.environments.python_env:PythonEnvironment", {"limits": limits.__dict__})

    async def go():
        envs = LocalEnvironments(spec)
        row = {"question": "48 cookies, half eaten, 24 more baked?", "answer": "... #### 48"}
        ep = await envs.open(row, seed=0)
        tools = [t["function"]["name"] for t in ep.tools]
        ran = await envs.step(ep.episode, ToolCall("python", {"code": "print(48 // 2 + 24)"}))
        spun = await envs.step(ep.episode, ToolCall("python", {"code": "while True: pass"}))
        right = await envs.close(ep.episode, "The answer is 48.\n#### 48")
        again = await envs.open(row, seed=1)
        wrong = await envs.close(again.episode, "#### 47")
        return tools, ran, spun, right, wrong

    tools, ran, spun, right, wrong = asyncio.run(go())
    assert tools == ["python"]
    assert (ran.text, ran.error) == ("48\n", None)
    assert "[stopped: more than 1 CPU seconds]" in spun.text
    assert (right, wrong) == (1.0, 0.0)


@ISOLATED
def test_processes_the_code_starts_die_with_it():
    """A child that leaves the code's session and outlives it is killed with the code (its PID
    namespace ends with it)."""
    marker = "31415.926"
    code = (
        "import subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        "print('left it running')\n"
    )
    out = run_python(code, LIMITS)
    assert out.output == "left it running\n" and out.stopped is None
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode():
                left.append(proc.name)
        except OSError:
            continue  # ended while looked at
    assert left == []
