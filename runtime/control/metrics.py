"""Where a run's numbers go: RUN_DIR/metrics.jsonl, the console, W&B, and RUN_DIR/curves.png.

metrics.jsonl is the record of truth (one JSON object per step, flushed as written); W&B is an
optional mirror; curves.png is drawn from the jsonl at close, so a resumed run that appends to the
same file gets one plot of the whole run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TextIO

from recipes.errors import UserError

WandbMode = Literal["online", "offline", "disabled"]

# What every step's record carries; the controller guarantees them, readers may rely on them.
REQUIRED_KEYS = (
    "step",
    "reward/mean",
    "loss",
    "kl",
    "policy_version",
    "time/step_s",
    "time/weight_sync_s",
)


class MetricsLogger:
    """Logs one record per training step; `close()` finishes W&B and draws curves.png."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        wandb_mode: WandbMode = "disabled",
        project: str = "forgesky",
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_id: str | None = None,
        total_steps: int | None = None,
        stream: TextIO | None = None,
        usd_per_hour: float | None = None,
        started: float | None = None,
        resumed_from: int | None = None,
    ):
        if wandb_mode not in ("online", "offline", "disabled"):
            raise UserError(f"wandb mode {wandb_mode!r}: use online, offline or disabled")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.curves_path = self.run_dir / "curves.png"
        self.total_steps = total_steps
        earlier = read_metrics(self.path)
        self.last_step = max((r["step"] for r in earlier), default=None)
        # the run's clock and dollars carry over a restart (resume): what the earlier processes
        # ran, and, where a restart redid steps after its checkpoint, the time they were lost
        self.usd_per_hour = usd_per_hour
        self.started = time.perf_counter() if started is None else started

        # the latest of each (a step redone after a restart keeps only its latest record)
        def latest(key: str) -> float:
            return max((float(r.get(key, 0.0)) for r in earlier), default=0.0)

        self._run_s_before = latest("time/run_s")
        self._usd_before = latest("cost/usd")
        self.recoveries = int(latest("recovery/count"))
        self.lost_s = latest("recovery/lost_s")
        if resumed_from is not None and earlier:
            at = next((r for r in earlier if r["step"] == resumed_from), None)
            redone = self._run_s_before - float(at.get("time/run_s", 0.0)) if at else 0.0
            self.recoveries += 1
            self.lost_s += max(redone, 0.0)
        self._file = self._open_for_append()
        self._stream = stream if stream is not None else sys.stdout
        self._bar = self._progress_bar()
        self._run = None
        if wandb_mode != "disabled":
            self._run = _start_wandb(
                wandb_mode, project, run_name, dict(config or {}), self.run_dir, resume_id
            )

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run id (None when W&B is disabled); saved in checkpoints to resume the run."""
        return self._run.id if self._run is not None else None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step: a jsonl line, a console line, and a W&B point."""
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items() if k != "step"}}
        record.update(self.clock())
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.last_step = record["step"]
        self._console(record)
        if self._run is not None:
            self._run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def clock(self) -> dict[str, float]:
        """The run's wall time so far (every process of it), the dollars it cost where the
        recipe gives a price (resources.usd_per_node_hour), and its recoveries."""
        run_s = self._run_s_before + time.perf_counter() - self.started
        out = {"time/run_s": run_s}
        if self.usd_per_hour is not None:
            here = (time.perf_counter() - self.started) / 3600 * self.usd_per_hour
            out["cost/usd"] = self._usd_before + here
        if self.recoveries:
            out["recovery/count"] = self.recoveries
            out["recovery/lost_s"] = self.lost_s
        return out

    def summary(self, steps: int, samples: int, predicted: Mapping[str, Any] | None) -> dict:
        """The run's end: its measured wall time beside the prediction the plan made
        (recipes/run_cost.py), the dollars and the dollars per 1,000 samples, the recoveries;
        written to RUN_DIR/summary.json (and W&B's summary) and returned."""
        clock = self.clock()
        out: dict[str, Any] = {
            "steps": steps,
            "samples": samples,
            "measured_wall_s": round(clock["time/run_s"], 1),
            "predicted": dict(predicted) if predicted else None,
        }
        if "cost/usd" in clock:
            out["cost_usd"] = round(clock["cost/usd"], 2)
            out["usd_per_1k_samples"] = round(clock["cost/usd"] / max(samples, 1) * 1000, 4)
        out["recoveries"] = self.recoveries
        out["recovery_lost_s"] = round(self.lost_s, 1)
        (self.run_dir / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
        if self._run is not None:
            self._run.summary.update({k: v for k, v in out.items() if k != "predicted"})
        return out

    def close(self) -> None:
        """Finish W&B, close the jsonl and write curves.png from the whole file. Idempotent."""
        if self._file.closed:
            return
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._run is not None:
            self._run.finish()
            _stop_wandb()
        plot_curves(read_metrics(self.path), self.curves_path)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_for_append(self) -> TextIO:
        f = self.path.open("a", encoding="utf-8")
        # A run killed mid-write leaves a partial last line: start ours on a fresh one.
        if f.tell() > 0:
            with self.path.open("rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write("\n")
        return f

    def _progress_bar(self) -> Any:
        isatty = getattr(self._stream, "isatty", None)
        if not (isatty and isatty()):
            return None
        from tqdm import tqdm

        return tqdm(
            total=self.total_steps,
            initial=self.last_step or 0,
            file=self._stream,
            desc="training",
            unit="step",
            dynamic_ncols=True,
        )

    def _console(self, record: Mapping[str, Any]) -> None:
        line = format_step(record, self.total_steps)
        if self._bar is None:
            self._stream.write(line + "\n")
            self._stream.flush()
            return
        self._bar.write(line, file=self._stream)
        self._bar.update(max(record["step"] - self._bar.n, 0))


def _slow_step_causes(record: Mapping[str, Any]) -> str:
    """` (3 graphs compiled, 12 allocator retries)` where the trainer saw either during the
    step (runtime.backends.gpu_memory.StepEvents; on several ranks, the most any rank saw),
    else nothing."""
    causes = []
    for key, most, one, many in (
        ("compile/graphs", "compile/ranks_max/graphs", "graph compiled", "graphs compiled"),
        (
            "memory/alloc_retries",
            "memory/ranks_max/alloc_retries",
            "allocator retry",
            "allocator retries",
        ),
    ):
        seen = [v for v in (record.get(key), record.get(most)) if isinstance(v, (int, float))]
        n = max(seen, default=0)
        if n > 0:
            causes.append(f"{int(n)} {one if n == 1 else many}")
    return f" ({', '.join(causes)})" if causes else ""


def format_step(record: Mapping[str, Any], total_steps: int | None = None) -> str:
    """`step 12/200 | reward 0.43 | loss 0.012 | kl 0.001 | 0.8 s/step` (missing parts left out)."""
    step = f"step {record['step']}" + (f"/{total_steps}" if total_steps else "")
    parts = [step]
    for key, label in (("reward/mean", "reward"), ("loss", "loss"), ("kl", "kl")):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{label} {record[key]:.3g}")
    if isinstance(record.get("eval/loss"), (int, float)):
        parts.append(f"held-out loss {record['eval/loss']:.3g}")
    if isinstance(record.get("time/step_s"), (int, float)):
        parts.append(f"{record['time/step_s']:.3g} s/step" + _slow_step_causes(record))
    if isinstance(record.get("cost/usd"), (int, float)):
        parts.append(f"${record['cost/usd']:,.2f}")
    if isinstance(record.get("eval/pass@1"), (int, float)):
        version = record.get("eval/version", record["step"])
        passes = [f"pass@1 {record['eval/pass@1']:.3g}"] + [
            f"{k.removeprefix('eval/')} {v:.3g}"
            for k, v in record.items()
            if k.startswith("eval/pass@") and k != "eval/pass@1"
        ]
        parts.append(f"eval of v{int(version)}: {', '.join(passes)}")
    return " | ".join(parts)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, oldest first; a step logged twice (a resumed run redoing
    steps after its last checkpoint) keeps its latest record. Partial lines are skipped."""
    path = Path(path)
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def plot_curves(records: list[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Draw reward/mean and kl against step, and with evaluations eval/* against the version
    evaluated, into a PNG (written atomically); an SFT run's (no reward): its train loss,
    held-out loss and tokens/s."""
    # The object API with the Agg canvas: no pyplot, no global backend switch in the caller.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    evals = sorted({k for r in records for k in r if k.startswith("eval/pass@")})
    keys: tuple[str, ...] = ("reward/mean", "kl", *(["eval"] if evals else []))
    if not any("reward/mean" in r for r in records) and any("eval/loss" in r for r in records):
        keys = ("loss", "eval/loss", "tokens_per_s")
    fig = Figure(figsize=(4.5 * len(keys), 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, key in zip(fig.subplots(1, len(keys)), keys, strict=True):
        if key == "eval":
            for name in evals:
                points = sorted(
                    (r.get("eval/version", r["step"]), r[name])
                    for r in records
                    if _finite(r.get(name))
                )
                ax.plot(*zip(*points, strict=True), marker=".", label=name.removeprefix("eval/"))
            ax.legend()
            ax.set_xlabel("policy version")
            ax.set_title("eval (held out)")
            ax.grid(alpha=0.3)
            continue
        points = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="." if len(points) < 50 else None)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


def check_wandb_login(mode: str) -> None:
    """Refuse W&B online without credentials (WANDB_API_KEY, a `wandb login`), before anything
    starts: wandb.init would only say so once every service is up."""
    if mode != "online":
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    try:
        # W&B's own look-up (its .netrc, settings file and host), as wandb.init makes it
        from wandb.apis import InternalApi

        found = InternalApi().api_key
    except Exception:  # noqa: BLE001 - cannot tell here: wandb.init will say what is wrong
        return
    if not found:
        raise UserError(
            "W&B online needs WANDB_API_KEY in the environment (or a `wandb login`); export "
            "it, or use --wandb offline or disabled"
        )


# How long the check before a run waits for W&B's server to answer.
WANDB_REACH_S = 10.0


def check_wandb_reachable(mode: str) -> None:
    """Refuse W&B online where its server does not answer, before anything starts: wandb.init
    would retry without end once every service is up, saying nothing of it on the console."""
    if mode != "online":
        return
    try:
        import requests
        from wandb.apis import InternalApi

        url = str(InternalApi().settings("base_url"))  # WANDB_BASE_URL, else W&B's own
    except Exception:  # noqa: BLE001 - cannot tell here: wandb.init will say what is wrong
        return
    try:
        requests.head(url, timeout=WANDB_REACH_S)
    except requests.Timeout:
        why = f"no answer within {WANDB_REACH_S:g} s"
    except requests.RequestException as e:
        reason = getattr(e.args[0] if e.args else None, "reason", None) or e
        why = str(reason).split("): ", 1)[-1]  # urllib3 names the connection first
    else:
        return
    raise UserError(
        f"W&B online cannot reach {url}: {why}; check this machine's network (or "
        "WANDB_BASE_URL), or use --wandb offline and `wandb sync` the run's wandb folder later"
    )


def _start_wandb(
    mode: str,
    project: str,
    run_name: str | None,
    config: dict[str, Any],
    run_dir: Path,
    resume_id: str | None,
) -> Any:
    import wandb  # only when enabled: importing it is slow and starts nothing we need otherwise

    try:
        return wandb.init(
            project=project,
            name=run_name,
            config=config,
            mode=mode,
            dir=str(run_dir),
            id=resume_id,
            resume="allow" if resume_id else None,
        )
    except wandb.errors.UsageError as e:
        _stop_wandb()
        raise UserError(
            f"W&B ({mode}): {str(e).strip().splitlines()[0]}; set WANDB_API_KEY, "
            "or use wandb mode offline or disabled"
        ) from None


def _stop_wandb() -> None:
    """Stop W&B's service process now. It is a child of this process: left to wandb's own
    exit hook, it would already have been ended by the run's host clean-up (which ends every
    child), and the hook's goodbye to it fails with a ConnectionResetError traceback."""
    import wandb

    wandb.teardown()


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars as Python numbers, so every record is plain JSON."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
