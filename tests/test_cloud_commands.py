"""`forgesky status`, `logs`, `down` and `cancel`, and what every command that reaches SkyPilot's
API server says: that it is about to start one, what an empty list is, SkyPilot's errors as one
plain line.

Only the calls that would reach the API server are replaced (tests/fake_sky.py); SkyPilot's own
health check, start-up decision and exception types are the real ones.
"""

from __future__ import annotations

import colorama
import pytest
from fake_sky import STARTING, FakeSky, from_server
from sky.server import common as server_common

import sky
from launcher.cli import main
from launcher.cloud import SERVER_STARTS, error_line

UP_RECORD = {
    "name": "grpo-qwen3-8b",
    "status": sky.ClusterStatus.UP,
    "resources_str": "1x AWS(p5.48xlarge, {'H100': 8})",
    "launched_at": 0,
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forgesky: error: "), err
    assert "\x1b" not in err and "Traceback" not in err, err
    return lines[0].removeprefix("forgesky: error: ")


# --- status / logs / down / cancel -------------------------------------------------------------


def test_status_clusters(monkeypatch, capsys):
    fake = FakeSky(monkeypatch, {"request-sky.status": [UP_RECORD]})
    code, out, err = run(capsys, "status", "grpo-qwen3-8b")
    assert (code, err) == (0, "")
    assert fake.names() == ["sky.status", "get"]
    assert fake.calls[0][2]["cluster_names"] == ["grpo-qwen3-8b"]
    row = out.splitlines()[1]
    assert row.startswith("grpo-qwen3-8b") and "UP" in row and "H100" in row


def test_status_managed_jobs(monkeypatch, capsys):
    records = [
        {
            "job_id": 7,
            "job_name": "grpo-qwen3-8b",
            "status": sky.ManagedJobStatus.RECOVERING,
            "cluster_resources": "1x[H100:8]",
            "recovery_count": 2,
            "job_duration": 3725,
        },
        {"job_id": 8, "job_name": "other", "status": sky.ManagedJobStatus.RUNNING},
    ]
    fake = FakeSky(monkeypatch, {"request-sky.jobs.queue": (records, 2, {}, 2)})
    assert main(["status", "--managed", "grpo-qwen3-8b"]) == 0
    assert fake.names() == ["sky.jobs.queue", "get"]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[1].split() == ["7", "grpo-qwen3-8b", "RECOVERING", "1x[H100:8]", "2", "1h02m"]


def test_logs_return_the_job_exit_code(monkeypatch, capsys):
    fake = FakeSky(monkeypatch, {"sky.tail_logs": 100})
    assert main(["logs", "grpo-qwen3-8b", "--no-follow"]) == 100
    assert fake.calls == [
        ("sky.tail_logs", (), {"cluster_name": "grpo-qwen3-8b", "job_id": None, "follow": False})
    ]
    fake = FakeSky(monkeypatch, {"sky.jobs.tail_logs": 0})
    assert main(["logs", "--managed", "grpo-qwen3-8b"]) == 0
    assert fake.calls == [
        ("sky.jobs.tail_logs", (), {"name": "grpo-qwen3-8b", "job_id": None, "follow": True})
    ]


def test_down_waits_for_the_request(monkeypatch, capsys):
    fake = FakeSky(monkeypatch, {"request-sky.down": None})
    assert main(["down", "grpo-qwen3-8b", "--yes"]) == 0
    assert fake.calls == [
        ("sky.down", ("grpo-qwen3-8b",), {}),
        ("stream_and_get", ("request-sky.down",), {}),
    ]
    assert "grpo-qwen3-8b is down" in capsys.readouterr().out


def test_down_without_a_terminal_needs_yes_and_calls_nothing(monkeypatch, capsys):
    fake = FakeSky(monkeypatch)
    code, _, err = run(capsys, "down", "grpo-qwen3-8b")
    assert code == 2 and "pass --yes" in one_error_line(err)
    assert fake.calls == []


def test_cancel_cluster_jobs_and_managed_jobs(monkeypatch, capsys):
    fake = FakeSky(monkeypatch, {"request-sky.cancel": None})
    assert main(["cancel", "grpo-qwen3-8b"]) == 0
    assert fake.calls[0] == ("sky.cancel", ("grpo-qwen3-8b",), {"all": True, "job_ids": None})
    fake = FakeSky(monkeypatch, {"request-sky.cancel": None})
    assert main(["cancel", "grpo-qwen3-8b", "--job-id", "3"]) == 0
    assert fake.calls[0] == ("sky.cancel", ("grpo-qwen3-8b",), {"all": False, "job_ids": [3]})
    fake = FakeSky(monkeypatch, {"request-sky.jobs.cancel": None})
    assert main(["cancel", "--managed", "grpo-qwen3-8b"]) == 0
    assert fake.names() == ["sky.jobs.cancel", "stream_and_get"]
    assert fake.calls[0][2] == {"name": "grpo-qwen3-8b"}


# --- an empty list is an answer, not an error --------------------------------------------------


def test_no_clusters_is_a_sentence_and_exit_0(monkeypatch, capsys):
    fake = FakeSky(monkeypatch, {"request-sky.status": []})
    code, out, err = run(capsys, "status")
    assert (code, out, err) == (0, "no clusters; `forgesky launch NAME` starts one\n", "")
    assert fake.calls[0][2]["cluster_names"] is None
    FakeSky(monkeypatch, {"request-sky.status": []})
    assert run(capsys, "status", "ghost", "gone") == (0, "no cluster named ghost, gone\n", "")


def _controller_not_up(state):
    # what SkyPilot's jobs queue raises on the server when its jobs controller is not UP
    # (sky.backends.backend_utils.is_controller_accessible), as the client receives it
    return from_server(
        sky.exceptions.ClusterNotUpError("No in-progress managed jobs.", cluster_status=state)
    )


def test_no_managed_jobs_is_a_sentence_and_exit_0(monkeypatch, capsys):
    # the jobs controller was never launched
    FakeSky(monkeypatch, {"request-sky.jobs.queue": _controller_not_up(None)})
    code, out, err = run(capsys, "status", "--managed")
    assert (code, err) == (0, "")
    assert out == "no managed jobs; `forgesky launch NAME --managed` submits one\n"
    # it stopped once the jobs ended: finished jobs are listed only by starting it again
    stopped = _controller_not_up(sky.ClusterStatus.STOPPED)
    assert stopped.cluster_status is sky.ClusterStatus.STOPPED
    FakeSky(monkeypatch, {"request-sky.jobs.queue": stopped})
    code, out, err = run(capsys, "status", "--managed")
    assert (code, err) == (0, "")
    assert out.startswith("no managed job in progress (SkyPilot's jobs controller has stopped;")
    # a controller that is up with no jobs, or none of the names asked for
    FakeSky(monkeypatch, {"request-sky.jobs.queue": ([], 0, {}, 0)})
    assert run(capsys, "status", "--managed")[:2] == (
        0,
        "no managed jobs; `forgesky launch NAME --managed` submits one\n",
    )
    other = [{"job_id": 8, "job_name": "other", "status": sky.ManagedJobStatus.RUNNING}]
    FakeSky(monkeypatch, {"request-sky.jobs.queue": (other, 1, {}, 1)})
    assert run(capsys, "status", "--managed", "grpo-x") == (0, "no managed job named grpo-x\n", "")


def test_a_jobs_controller_still_starting_is_an_error(monkeypatch, capsys):
    FakeSky(monkeypatch, {"request-sky.jobs.queue": _controller_not_up(sky.ClusterStatus.INIT)})
    code, out, err = run(capsys, "status", "--managed")
    assert (code, out) == (1, "")
    assert one_error_line(err) == "No in-progress managed jobs."


# --- SkyPilot's errors: one plain line ---------------------------------------------------------


def test_skypilots_coloured_errors_are_one_plain_line(monkeypatch, capsys):
    # as sky.backends.backend_utils.check_cluster_available words them
    yellow, bright, reset = colorama.Fore.YELLOW, colorama.Style.BRIGHT, colorama.Style.RESET_ALL
    missing = from_server(
        sky.exceptions.ClusterDoesNotExist(f"{yellow}Cluster 'ghost' does not exist.{reset}")
    )
    FakeSky(monkeypatch, {"sky.tail_logs": missing})
    code, out, err = run(capsys, "logs", "ghost")
    assert (code, out) == (1, "")
    assert one_error_line(err) == "Cluster 'ghost' does not exist."

    not_up = from_server(
        sky.exceptions.ClusterNotUpError(
            f"{yellow}Cancelling jobs: skipped for cluster 'grpo' (status: INIT).{reset} Wait "
            f"for a launch to finish, or use this command to try to transition the cluster to "
            f"UP: {bright}sky start grpo{reset}\nmore",
            cluster_status=sky.ClusterStatus.INIT,
        )
    )
    FakeSky(monkeypatch, {"request-sky.cancel": not_up})
    code, out, err = run(capsys, "cancel", "grpo")
    assert (code, out) == (1, "")
    assert one_error_line(err) == (
        "Cancelling jobs: skipped for cluster 'grpo' (status: INIT). Wait for a launch to "
        "finish, or use this command to try to transition the cluster to UP: sky start grpo"
    )

    FakeSky(monkeypatch, {"request-sky.down": from_server(sky.exceptions.ClusterDoesNotExist())})
    code, _, err = run(capsys, "down", "ghost", "--yes")
    assert code == 1 and one_error_line(err) == "ClusterDoesNotExist"


def test_error_line_drops_every_terminal_escape():
    error = sky.exceptions.NotSupportedError(
        "\n\x1b[1;33m\x1b]8;;https://docs.skypilot.co\x1b\\docs\x1b]8;;\x1b\\ \x1b(Bsaid\x1b[0m\n"
    )
    assert error_line(error) == "docs said"
    assert error_line(sky.exceptions.NotSupportedError("a\tb\x07")) == "a\\tb\\x07"


# --- SkyPilot's local API server ---------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["status", "--managed"],
        ["logs", "grpo-qwen3-8b"],
        ["down", "grpo-qwen3-8b", "--yes"],
        ["cancel", "grpo-qwen3-8b"],
    ],
)
def test_a_command_that_starts_the_api_server_says_so_before_the_wait(monkeypatch, capsys, argv):
    results = {
        "request-sky.status": [UP_RECORD],
        "request-sky.jobs.queue": ([], 0, {}, 0),
        "sky.tail_logs": 0,
        "request-sky.down": None,
        "request-sky.cancel": None,
    }
    fake = FakeSky(monkeypatch, results, server_up=False)
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    # SkyPilot's own check found no server and started one, once, after the line that says so
    assert fake.names().count("start the API server") == 1
    assert fake.names()[0] == "start the API server"
    assert err.count(SERVER_STARTS) == 1
    assert err.index(SERVER_STARTS) < err.index(STARTING)
    assert "`sky api stop` stops it" in SERVER_STARTS


def test_launch_says_so_too(monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    fake = FakeSky(monkeypatch, {"request-sky.launch": (1, None)}, server_up=False)
    code, out, err = run(capsys, "launch", "qwen3-1.7b", "--gpus", "4", "--yes")
    assert code == 0, err
    assert fake.names()[:2] == ["start the API server", "sky.launch"]
    assert err.index(SERVER_STARTS) < err.index(STARTING)
    assert "job 1 running on cluster grpo-qwen3-1.7b" in out


def test_a_running_api_server_is_not_announced(monkeypatch, capsys):
    fake = FakeSky(monkeypatch, {"request-sky.status": [UP_RECORD]})
    code, _, err = run(capsys, "status")
    assert (code, err) == (0, "")
    assert "start the API server" not in fake.names()


@pytest.fixture
def remote_endpoint(monkeypatch):
    """An API server elsewhere (`sky api login`), as SkyPilot's environment variable names it."""
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", "http://skypilot.example.com:46580")
    cached = (server_common.get_server_url, server_common.is_api_server_local)
    for function in cached:
        function.cache_clear()
    yield
    for function in cached:
        function.cache_clear()


def test_an_unreachable_remote_api_server_is_one_line_and_never_started(
    monkeypatch, capsys, remote_endpoint
):
    fake = FakeSky(monkeypatch, {"request-sky.status": [UP_RECORD]}, server_up=False)
    code, out, err = run(capsys, "status")
    assert (code, out) == (1, "")
    assert one_error_line(err).startswith(
        "Could not connect to SkyPilot API server at http://skypilot.example.com:46580."
    )
    assert fake.calls == []
