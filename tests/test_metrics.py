"""MetricsLogger: jsonl record, console lines, curves.png, resume, and W&B modes."""

import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from recipes.errors import UserError
from runtime.control.metrics import REQUIRED_KEYS, MetricsLogger, format_step, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int) -> dict:
    return {
        "reward/mean": 0.1 * step,
        "loss": torch.tensor(0.5 / step),
        "kl": 0.001 * step,
        "policy_version": step - 1,
        "time/step_s": 0.8,
        "time/weight_sync_s": 0.05,
    }


def run_logged(run_dir, steps, **kw):
    out = io.StringIO()
    with MetricsLogger(run_dir, stream=out, **kw) as logger:
        for step in steps:
            logger.log(step, step_metrics(step))
    return out.getvalue()


def subprocess_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return {**env, "HOME": str(tmp_path / "home"), "WANDB_DIR": str(tmp_path / "wandb"), **extra}


def test_each_step_is_one_flushed_json_line(tmp_path):
    logger = MetricsLogger(tmp_path, stream=io.StringIO())
    logger.log(1, step_metrics(1))
    # readable before close: a crash loses nothing already logged
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = [json.loads(line) for line in lines]
    # the run's wall time so far (every process of it) rides on each record
    assert 0 <= first[0].pop("time/run_s") < 60
    assert first == [
        {
            "step": 1,
            "reward/mean": 0.1,
            "loss": 0.5,
            "kl": 0.001,
            "policy_version": 0,
            "time/step_s": 0.8,
            "time/weight_sync_s": 0.05,
        }
    ]
    logger.log(2, step_metrics(2))
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(set(REQUIRED_KEYS) <= set(r) for r in records)
    assert isinstance(records[1]["loss"], float)


def test_plain_console_lines_when_not_a_tty(tmp_path):
    out = run_logged(tmp_path, [1, 2], total_steps=200)
    assert out.splitlines() == [
        "step 1/200 | reward 0.1 | loss 0.5 | kl 0.001 | 0.8 s/step",
        "step 2/200 | reward 0.2 | loss 0.25 | kl 0.002 | 0.8 s/step",
    ]


def test_progress_bar_on_a_tty(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with MetricsLogger(tmp_path, stream=out, total_steps=3) as logger:
        for step in (1, 2, 3):
            logger.log(step, step_metrics(step))
    text = out.getvalue()
    assert "step 3/3 | reward 0.3 | loss 0.167 | kl 0.003 | 0.8 s/step" in text
    assert "3/3 [" in text  # the tqdm bar, redrawn in place
    assert "\r" in text


def test_format_step_leaves_out_missing_parts():
    assert format_step({"step": 7, "reward/mean": 0.4321}) == "step 7 | reward 0.432"


def test_a_step_line_says_what_the_trainer_compiled_or_retried_during_it():
    record = {"step": 6, "loss": 5.88, "time/step_s": 42.6}
    assert format_step(record, 8) == "step 6/8 | loss 5.88 | 42.6 s/step"
    quiet = {**record, "compile/graphs": 0.0, "memory/alloc_retries": 0.0}
    assert format_step(quiet, 8) == "step 6/8 | loss 5.88 | 42.6 s/step"
    busy = {**record, "compile/graphs": 3.0, "memory/alloc_retries": 1.0}
    assert format_step(busy, 8) == (
        "step 6/8 | loss 5.88 | 42.6 s/step (3 graphs compiled, 1 allocator retry)"
    )
    assert format_step({**quiet, "compile/graphs": 1.0}).endswith("s/step (1 graph compiled)")
    # on several ranks, the most any rank saw: a rank that compiled holds the others up
    ranks = {**quiet, "compile/ranks_max/graphs": 2.0, "memory/ranks_max/alloc_retries": 0.0}
    assert format_step(ranks).endswith("s/step (2 graphs compiled)")


def test_a_step_of_several_ranks_counts_the_graphs_any_rank_compiled_and_names_its_guard():
    from runtime.control.services import rank_figures

    zero = {"loss": 1.0, "compile/graphs": 0.0, "memory/alloc_retries": 0.0}
    one = {"loss": 1.0, "compile/graphs": 1.0, "memory/alloc_retries": 2.0,
           "compile/reasons": ["run (runtime/backends/blocks.py:85): 2 <= args[0].size()[0]"]}  # fmt: skip
    stats = rank_figures([zero, one])
    assert stats["compile/graphs"] == 0.0 and stats["compile/ranks_max/graphs"] == 1.0
    assert stats["memory/ranks_max/alloc_retries"] == 2.0
    assert stats["compile/reasons"] == [
        "rank 1: run (runtime/backends/blocks.py:85): 2 <= args[0].size()[0]"
    ]
    assert "compile/reasons" not in rank_figures([zero, zero])
    assert "compile/ranks_max/graphs" not in rank_figures([zero])


def test_close_writes_a_png_of_the_curves(tmp_path):
    run_logged(tmp_path, range(1, 6))
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(PNG_MAGIC)
    assert len(png) > 5000
    assert not (tmp_path / "curves.png.tmp").exists()


def test_close_is_idempotent_and_plots_an_empty_run(tmp_path):
    logger = MetricsLogger(tmp_path, stream=io.StringIO())
    logger.close()
    logger.close()
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_MAGIC)


def test_resume_appends_and_the_plot_covers_the_whole_file(tmp_path):
    run_logged(tmp_path, [1, 2, 3])
    first_png = (tmp_path / "curves.png").read_bytes()
    resumed = MetricsLogger(tmp_path, stream=io.StringIO())
    assert resumed.last_step == 3
    for step in (4, 5):
        resumed.log(step, step_metrics(step))
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert (tmp_path / "curves.png").read_bytes() != first_png


def test_resume_after_a_crash_mid_line_and_redone_steps(tmp_path):
    run_logged(tmp_path, [1, 2, 3])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward/me')  # killed while writing
    # resumed from the checkpoint of step 2: steps 3 and 4 are done again
    logger = MetricsLogger(tmp_path, stream=io.StringIO())
    logger.log(3, {**step_metrics(3), "reward/mean": 0.9})
    logger.log(4, step_metrics(4))
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["reward/mean"] == 0.9
    last = (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]
    assert json.loads(last)["step"] == 4


def test_unknown_wandb_mode_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="wandb mode 'on'"):
        MetricsLogger(tmp_path, wandb_mode="on")


def test_disabled_mode_never_imports_wandb(tmp_path):
    code = textwrap.dedent(
        f"""
        import io, sys
        from runtime.control.metrics import MetricsLogger
        logger = MetricsLogger({str(tmp_path)!r}, wandb_mode="disabled", stream=io.StringIO())
        logger.log(1, {{"reward/mean": 0.5, "kl": 0.0}})
        assert logger.wandb_run_id is None
        logger.close()
        print(sorted(m for m in sys.modules if m == "wandb" or m.startswith("wandb.")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(tmp_path),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert (tmp_path / "curves.png").exists()


def test_offline_wandb_records_the_run_locally_and_resumes_by_id(tmp_path):
    run_dir = tmp_path / "run"
    code = textwrap.dedent(
        f"""
        import io, sys
        from runtime.control.metrics import MetricsLogger
        resume = sys.argv[1] if len(sys.argv) > 1 else None
        logger = MetricsLogger({str(run_dir)!r}, wandb_mode="offline", project="forgesky-test",
                               run_name="t", config={{"grpo": {{"steps": 2}}}},
                               resume_id=resume, stream=io.StringIO())
        start = (logger.last_step or 0) + 1
        for step in (start, start + 1):
            logger.log(step, {{"reward/mean": 0.5 * step, "kl": 0.0, "loss": 1.0}})
        logger.close()
        print(logger.wandb_run_id)
        """
    )

    def run(*args):
        out = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            env=subprocess_env(tmp_path, WANDB_SILENT="true"),
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()[-1]

    run_id = run()
    assert run_id
    run_files = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(run_files) == 1 and run_files[0].stat().st_size > 0
    assert run(run_id) == run_id
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


def test_online_wandb_without_a_key_is_a_user_error(tmp_path):
    code = textwrap.dedent(
        f"""
        from recipes.errors import UserError
        from runtime.control.metrics import MetricsLogger
        try:
            MetricsLogger({str(tmp_path / "run")!r}, wandb_mode="online")
        except UserError as e:
            print(e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(tmp_path),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("W&B (online): ")
    assert "WANDB_API_KEY" in line
    assert "\n" not in line


def test_dollars_spent_ride_on_every_record_and_the_progress_line(tmp_path):
    out = io.StringIO()
    # started half an hour ago at $10 an hour: $5 spent by the first step
    logger = MetricsLogger(
        tmp_path, stream=out, usd_per_hour=10.0, started=time.perf_counter() - 1800
    )
    logger.log(1, step_metrics(1))
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert 5.0 <= record["cost/usd"] < 5.5
    assert record["time/run_s"] >= 1800
    assert "| $5." in out.getvalue()
    done = logger.summary(1, 128, {"wall_s": 1900.0})
    logger.close()
    assert done["cost_usd"] >= 5.0
    assert done["usd_per_1k_samples"] == pytest.approx(done["cost_usd"] / 128 * 1000, rel=1e-3)
    assert done["predicted"] == {"wall_s": 1900.0} and done["measured_wall_s"] >= 1800
    assert json.loads((tmp_path / "summary.json").read_text()) == done


def test_a_recovery_carries_the_clock_and_counts_the_time_lost(tmp_path):
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step, run_s in ((1, 100.0), (2, 200.0), (3, 300.0)):
            record = {"step": step, "reward/mean": 0.1, "loss": 0.5, "time/run_s": run_s}
            f.write(json.dumps({**record, "cost/usd": run_s / 3600 * 36}) + "\n")
    # preempted after step 3, resumed from the checkpoint of step 1: steps 2-3 (200 s) lost
    logger = MetricsLogger(
        tmp_path,
        stream=io.StringIO(),
        usd_per_hour=36.0,
        started=time.perf_counter() - 50,
        resumed_from=1,
    )
    logger.log(2, step_metrics(2))
    logger.close()
    record = read_metrics(tmp_path / "metrics.jsonl")[1]
    assert record["recovery/count"] == 1
    assert record["recovery/lost_s"] == pytest.approx(200.0)
    assert 350 <= record["time/run_s"] < 400  # 300 before the restart, 50 since
    assert 3.5 <= record["cost/usd"] < 4.0  # $3 before, $0.5 since


@pytest.mark.parametrize("resumes", [1, 2])
def test_the_runs_last_line_counts_its_recoveries_in_words(tmp_path, resumes):
    """The run's last line: `1 recovery`, `2 recoveries`."""
    from recipes import load_recipe, plan
    from runtime.control.run import summary_line

    tiny = load_recipe("tiny")
    first = MetricsLogger(tmp_path, stream=io.StringIO())
    for step in (1, 2):
        first.log(step, step_metrics(step))
    first.close()
    for _ in range(resumes):  # each resumes from step 1 and redoes step 2
        logger = MetricsLogger(tmp_path, stream=io.StringIO(), resumed_from=1)
        logger.log(2, step_metrics(2))
        line = summary_line(logger, tiny, plan(tiny, 0), 2, 16)
        logger.close()
    assert line.rpartition("; ")[2].startswith(
        "1 recovery, " if resumes == 1 else "2 recoveries, "
    ), line


def test_the_clock_carries_the_latest_time_when_a_redone_step_came_last(tmp_path):
    with (tmp_path / "metrics.jsonl").open("w") as f:
        # steps 1-3, then a restart from step 1 redid step 2 before the next stop
        for step, run_s in ((1, 100.0), (2, 200.0), (3, 300.0), (2, 350.0)):
            f.write(json.dumps({"step": step, "loss": 0.5, "time/run_s": run_s}) + "\n")
    logger = MetricsLogger(tmp_path, stream=io.StringIO(), started=time.perf_counter() - 10)
    logger.log(3, step_metrics(3))
    logger.close()
    assert 360 <= read_metrics(tmp_path / "metrics.jsonl")[-1]["time/run_s"] < 400
