"""An SFT run: the recipe's rows, packed, through the TorchTitan trainer, with held-out loss,
metrics, DCP checkpoints, resume and the model folder at the end. The trainer is the one-process
CPU trainer, or the trainer actor's FSDP2 ranks (GPUs, or gloo ranks on CPU) driven from this
same loop (runtime.sft.ranks).

RUN_DIR holds what a GRPO run's holds: config.json (the recipe and its plan), metrics.jsonl
(train loss, held-out loss `eval/loss`, tokens/s, MFU where the GPU's peak is known),
curves.png, checkpoints/step_N (the trainer's DCP folder and `sft_state.json`: the position
in the data and the row counts), and model/ (a Hugging Face folder, or a LoRA run's adapter).

A run dir holding a committed checkpoint is resumed from it: the weights, AdamW and the
schedule from the trainer's folder, the data from the position kept beside it, so the steps
after it are the steps an unbroken run takes.

Each step trains on `sft.tokens_per_step` tokens of whole rows in the recipe's seeded order
(epoch after epoch), packed into micro-batches of `trainer.tokens_per_micro_batch` tokens.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recipes import UserError
from recipes.sft_rows import check_rows
from runtime.sft.data import ChatEncoder, Counts, Example, examples, micro_batches

STATE_FILE = "sft_state.json"
# the micro-batch of the CPU trainer where the recipe leaves it auto
CPU_TOKENS_PER_MICRO_BATCH = 1024


class RowStream:
    """The training rows, encoded, in an order drawn from (seed, epoch), epoch after epoch. Its
    position (epoch, index of the next row) and counts are what a checkpoint keeps."""

    def __init__(
        self, rows: Sequence[Mapping[str, Any]], encoder: ChatEncoder, dataset: Any, seed: int
    ):
        self.rows, self.encoder, self.dataset, self.seed = rows, encoder, dataset, seed
        self.epoch = 0
        self.index = 0
        self.counts = Counts()
        self._order: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def take(self, budget: int) -> list[Example]:
        """Whole rows of at most `budget` tokens in all (at least one); a row that would go past
        it is left for the next call (read again from its position)."""
        taken: list[Example] = []
        used = 0
        while True:
            if self.index >= len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
            where, before = (self.epoch, self.index), asdict(self.counts)
            row = self.order(self.epoch)[self.index]
            self.index += 1
            found = list(examples(self.rows, [row], self.encoder, self.dataset, self.counts))
            if not found:
                continue  # dropped (too long), counted
            ex = found[0]
            if taken and used + len(ex.ids) > budget:
                self.epoch, self.index = where
                self.counts = Counts(**before)
                return taken
            taken.append(ex)
            used += len(ex.ids)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "counts": asdict(self.counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.counts = Counts(**state["counts"])


@dataclass(frozen=True)
class Taken:
    """A step's rows and their packed micro-batches, with the stream's state after them (what
    a checkpoint of that step keeps) and the seconds taking and packing them took."""

    rows: list[Example]
    packs: list[Any]
    after: dict[str, Any]
    seconds: float


class Ahead:
    """The next step's rows, taken and packed in a thread of their own while the trainer runs
    the current step: in line, that work was 0.4-0.5 s of qwen3-1.7b-sft's 4-6 s steps. The
    stream then stands one step ahead of the trained steps; `Taken.after` is where they leave
    it."""

    def __init__(self, stream: RowStream, budget: int, micro: int, packing: str):
        self.stream, self.budget, self.micro, self.packing = stream, budget, micro, packing
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sft-rows")
        self._next: Future[Taken] | None = None

    def _take(self) -> Taken:
        start = time.perf_counter()
        rows = self.stream.take(self.budget)
        packs = list(micro_batches(iter(rows), self.micro, pad_to=False, packing=self.packing))
        return Taken(rows, packs, self.stream.state_dict(), time.perf_counter() - start)

    def ask(self) -> None:
        """Start taking the next step's rows."""
        self._next = self._pool.submit(self._take)

    def get(self) -> Taken:
        """The rows asked for (taken now where none were asked for)."""
        if self._next is None:
            self.ask()
        assert self._next is not None
        future, self._next = self._next, None
        return future.result()

    def close(self) -> None:
        """Drop rows taken for a step that will not run; the thread ends."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def load_rows(dataset: Any, path: str, split: str, what: str) -> Any:
    """One split of the data (a Hub dataset, a local file or folder), checked for the fields
    and the assistant turns the run needs."""
    from runtime.tasks.data import load_hf_dataset

    if path.startswith("builtin:"):
        raise UserError(f"{what} {path!r}: shipped tasks hold GRPO prompts, not SFT chats")
    import datasets

    shown = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # a bad file's one line stays one line
    try:
        rows = load_hf_dataset(path, dataset.config, split)
    finally:
        if shown:
            datasets.enable_progress_bars()
    check_rows(rows, dataset, path)
    return rows


def nothing_kept(dataset: Any, path: str, scope: str = "") -> str:
    """The line for data with no row left to train on: each longer than dataset.max_tokens,
    dropped, or cut before its assistant turn."""
    how = (
        "a longer one is dropped"
        if dataset.overlong == "drop"
        else "cut to it, none keeps an assistant token"
    )
    return (
        f"dataset {path!r}: no row {scope}fits dataset.max_tokens {dataset.max_tokens} after "
        f"the chat template ({how}: dataset.overlong {dataset.overlong}); nothing to train "
        "on: raise dataset.max_tokens"
    )


def held_out(recipe: Any, encoder: ChatEncoder) -> list[Example]:
    """The first eval.rows rows of the held-out data, encoded as the training rows are."""
    e, d = recipe.eval, recipe.dataset
    rows = load_rows(d, e.path or d.path, e.split, "eval.path")
    n = min(e.rows, len(rows))
    return list(examples(rows, range(n), encoder, d, Counts()))


def micro_tokens(recipe: Any, attention: str = "document") -> int:
    """The CPU trainer's micro-batch: the recipe's, else the larger of 1,024 tokens and a row."""
    t = recipe.trainer.tokens_per_micro_batch
    if t != "auto":
        return t
    return max(CPU_TOKENS_PER_MICRO_BATCH, recipe.dataset.max_tokens)


def step_flops(spec: Any, lengths: Sequence[int], lora: bool) -> float:
    """The model FLOPs of a training step on rows of `lengths` tokens: 6 per parameter and token
    (forward and backward; 4 with LoRA's frozen base, whose weights take no gradient) and the
    causal attention of each row (its scores and their product with the values)."""
    tokens = sum(lengths)
    dense = (4.0 if lora else 6.0) * spec.num_params() * tokens
    width = spec.n_heads * spec.head_dim
    attention = 6.0 * spec.n_layers * width * sum(n * n for n in lengths)
    return dense + attention


def one_process_trainer(recipe: Any) -> Any:
    """The one-process CPU trainer of `recipe` (TitanTrainer, packed rows with a document mask);
    `recipe.sft.steps` sets its schedule's length."""
    import torch

    from runtime.backends import OptimizerConfig, TitanTrainer
    from runtime.backends.build import initial_weights, model_spec

    spec = model_spec(recipe)
    torch.manual_seed(recipe.sft.seed)
    return TitanTrainer(
        spec,
        OptimizerConfig.from_grpo(recipe.sft),
        weights=initial_weights(recipe, spec),
        seed=recipe.sft.seed,
        lora=recipe.model.lora,
        attention="document",  # packed rows on the CPU (runtime.models.packing)
    )


@dataclass
class Data:
    """A run's data, checked: the chat template it applies, its training rows and its held-out
    examples."""

    encoder: ChatEncoder
    stream: RowStream
    evaluation: list[Example]


def prepare(recipe: Any) -> Data:
    """The recipe's tokenizer, training rows and held-out examples, checked: what needs the
    tokenizer (its chat template, rows that fit dataset.max_tokens) is a UserError here, as the
    run starts and before its trainer does."""
    from runtime.backends.build import load_tokenizer

    encoder = ChatEncoder(
        load_tokenizer(recipe), thinking=recipe.model.thinking, where="model.tokenizer"
    )
    d = recipe.dataset
    stream = RowStream(load_rows(d, d.path, d.split, "dataset.path"), encoder, d, recipe.sft.seed)
    if not any(True for _ in examples(stream.rows, range(len(stream.rows)), encoder, d, Counts())):
        raise UserError(nothing_kept(d, d.path))
    e = recipe.eval
    evaluation = held_out(recipe, encoder) if e.enabled else []
    if e.enabled and not evaluation:
        raise UserError(nothing_kept(d, e.path or d.path, f"of the first {e.rows} (eval.rows) "))
    return Data(encoder, stream, evaluation)


def _step(trainer: Any, packs: list[Any], profile_step: int) -> dict[str, Any]:
    """`trainer.sft_step(packs)`; a trainer in this process gets what the trainer actor's ranks
    add themselves (runtime.backends.profiling.measured_step), its profile as a list of one."""
    if getattr(trainer, "profiles_itself", False):
        return trainer.sft_step(packs)
    from runtime.backends.build import device
    from runtime.backends.profiling import every_rank, measured_step

    stats = measured_step(
        lambda: trainer.sft_step(packs), device(), profile_step == trainer.step + 1
    )
    every_rank([stats], stats)
    return stats


def run(
    recipe: Any,
    run_dir: Path,
    *,
    data: Data | None = None,
    stopping: Callable[[], bool] = lambda: False,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    wandb_mode: str = "disabled",
    log: Callable[[str], None] = print,
    start_trainer: Callable[[Any], Any] = one_process_trainer,
    tokens_per_micro_batch: int | None = None,
    peak_flops: float | None = None,
    run_plan: Any = None,
    started: float | None = None,
) -> dict[str, Any]:
    """Train `recipe` (an SFT recipe) into `run_dir`; returns the last step's record.

    `start_trainer(recipe)` gives the trainer once the data is checked: the one-process CPU
    trainer, or the trainer actor's ranks (runtime.sft.ranks.RankTrainer); either takes
    `sft_step`, `sft_loss`, `save_checkpoint`, `checkpoint_written`, `load_checkpoint` and
    counts `step`. `data`: the recipe's, prepared (default: prepared here). `stopping()`: true
    once a stop is asked for (Ctrl-C, SIGTERM): the run ends at the step boundary, with a
    checkpoint of its last step and no model folder, as a GRPO run does.
    `tokens_per_micro_batch`: the planned micro-batch (default: the CPU's); `peak_flops`: the
    trainer's GPUs' bf16 peak in all, for the MFU; `started`: when the run's process started
    (time.perf_counter), the run's clock's zero."""
    started = time.perf_counter() if started is None else started
    from recipes import plan
    from runtime.backends.build import model_spec
    from runtime.backends.profiling import say_recompiles, write_profiles
    from runtime.control import checkpoint
    from runtime.control.metrics import MetricsLogger, read_metrics
    from runtime.control.run import recorded_config, summary_line, usd_per_hour, write_recorded

    total = steps or recipe.sft.steps
    every = recipe.sft.checkpoint_interval if checkpoint_every is None else checkpoint_every
    data = data or prepare(recipe)
    stream, evaluation = data.stream, data.evaluation
    run_dir.mkdir(parents=True, exist_ok=True)
    run_plan = run_plan or plan(recipe, 0)
    write_recorded(run_dir, recorded_config(recipe, run_plan))
    spec = model_spec(recipe)
    trainer = start_trainer(
        recipe.model_copy(update={"sft": recipe.sft.model_copy(update={"steps": total})})
    )
    root = run_dir / "checkpoints"
    ckpt = checkpoint.latest(root)
    state: dict[str, Any] = {}
    if ckpt is not None:
        log(f"resuming from the checkpoint of step {ckpt.step} ({ckpt.path})")
        trainer.load_checkpoint(str(ckpt.path))
        state = json.loads((ckpt.path / STATE_FILE).read_text())
        stream.load_state_dict(state["data"])
    began, saved = trainer.step, trainer.step if ckpt is not None else None
    micro = tokens_per_micro_batch or micro_tokens(recipe)

    def eval_loss() -> float:
        summed, count = trainer.sft_loss(list(micro_batches(iter(evaluation), micro, pad_to=False)))
        return summed / max(count, 1)

    metrics = MetricsLogger(
        run_dir,
        wandb_mode=wandb_mode,  # type: ignore[arg-type]
        run_name=run_dir.name,
        config=recipe.model_dump(mode="json"),
        resume_id=state.get("wandb_run_id"),
        total_steps=total,
        usd_per_hour=usd_per_hour(recipe, run_plan),
        started=started,
        resumed_from=ckpt.step if ckpt is not None else None,
    )
    record: dict[str, Any] = {}
    position = stream.state_dict()  # where the trained steps leave the data
    ahead = Ahead(stream, recipe.sft.tokens_per_step, micro, recipe.sft.packing)
    try:
        if trainer.step == 0 and evaluation:
            metrics.log(0, {"eval/loss": eval_loss()})
        while trainer.step < total and not stopping():
            start = time.perf_counter()
            taken = ahead.get()
            data_s = time.perf_counter() - start
            if trainer.step + 1 < total:
                ahead.ask()  # the next step's rows, while this one trains
            rows, packs = taken.rows, taken.packs
            stats = _step(trainer, packs, recipe.trainer.profile_step)
            position = taken.after
            seconds = time.perf_counter() - start
            tokens = sum(len(e.ids) for e in rows)
            flops = step_flops(spec, [len(e.ids) for e in rows], recipe.model.lora is not None)
            record = {
                "loss": stats["loss"],
                "grad_norm": stats["grad_norm"],
                "lr": stats["lr"],
                "tokens": tokens,
                "trained_tokens": sum(p.trained_tokens for p in packs),
                "rows": len(rows),
                "micro_batches": len(packs),
                "tokens_per_s": tokens / seconds,
                # the CPU has no peak to measure against
                "mfu": flops / seconds / peak_flops if peak_flops else None,
                "time/step_s": seconds,
                # where a slow step's time went: the wait for its rows (taken and packed
                # during the step before, but the first), the trainer's own step (rank 0's,
                # its wait for a checkpoint's copy included); the rest is the call's way to
                # the ranks and back
                "time/data_s": data_s,
                "time/data_take_s": taken.seconds,
                "time/train_s": stats.get("time/train_s", seconds - data_s),
                "data/epoch": position["epoch"],
                "data/rows_truncated": position["counts"]["truncated"],
                "data/rows_dropped": position["counts"]["dropped"],
            }
            step = trainer.step
            say_recompiles(stats, step, log, first=step == began + 1)
            profiles = stats.pop("profile", None)  # the recipe's trainer.profile_step
            if profiles:
                write_profiles(run_dir, step, profiles, log)
                record["trainer/profiled"] = 1.0  # its time includes the profiler's
            due = recipe.eval.every and step % recipe.eval.every == 0
            if evaluation and (due or step == total):
                record["eval/loss"] = eval_loss()
            record |= {
                k: v
                for k, v in stats.items()
                if k.startswith(("memory/", "compile/", "time/")) and k not in record
            }
            metrics.log(step, record)
            if (every and step % every == 0) or step == total:
                path = _save(trainer, position, root, step, metrics.wandb_run_id)
                saved = step
                log(f"checkpoint step {step} -> {path}")
        if trainer.step < total and trainer.step not in (began, saved):  # stopped: keep it
            path = _save(trainer, position, root, trainer.step, metrics.wandb_run_id)
            log(f"checkpoint step {trainer.step} -> {path}")
        if trainer.step >= total:  # a stopped run leaves its checkpoints, not a model
            write = getattr(trainer, "write_model", None)
            if write is not None:  # the actor's ranks write it from their memory
                model = write(run_dir, recipe, trainer.step)
            else:
                from runtime.export import write_run_model

                model = write_run_model(run_dir, recipe, trainer.step)
            log(f"model -> {model}")
        rows = sum(int(r.get("rows", 0)) for r in _latest_records(read_metrics(metrics.path)))
        log(summary_line(metrics, recipe, run_plan, trainer.step, rows))
        if trainer.step < total:
            log(f"stopped at step {trainer.step}; outputs in {run_dir}")
    finally:
        ahead.close()
        metrics.close()
    return {"step": trainer.step, **record}


def _latest_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record a step, the latest (a step redone after a resume keeps its last)."""
    return list({r["step"]: r for r in records}.values())


def _save(
    trainer: Any, position: dict[str, Any], root: Path, step: int, wandb_id: str | None
) -> Path:
    from runtime.control import checkpoint

    partial = checkpoint.begin(root, step)
    trainer.save_checkpoint(str(partial))
    trainer.checkpoint_written(wait=True)
    state = {"step": step, "data": position, "wandb_run_id": wandb_id}
    (partial / STATE_FILE).write_text(json.dumps(state) + "\n")
    return checkpoint.commit(root, partial, step).path


def evaluate(recipe: Any, weights: Mapping[str, Any], log: Callable[[str], None] = print) -> dict:
    """`forgesky eval` of an SFT model: its held-out loss (the mean cross-entropy of the
    held-out rows' assistant tokens), from its weights under HF names."""
    import torch

    from runtime.backends.build import load_tokenizer, model_spec
    from runtime.models import build_model, from_hf

    start = time.perf_counter()
    encoder = ChatEncoder(
        load_tokenizer(recipe), thinking=recipe.model.thinking, where="model.tokenizer"
    )
    rows = held_out(recipe, encoder)
    spec = model_spec(recipe)
    model = build_model(spec, attention="document")
    model.load_state_dict(from_hf(dict(weights), spec), strict=True)
    model.eval()
    from runtime.sft.train import packed_loss

    micro = micro_tokens(recipe)
    summed, count = 0.0, 0
    with torch.no_grad():
        for pack in micro_batches(iter(rows), micro, pad_to=False):
            summed += float(packed_loss(model, pack, "document", torch.device("cpu")))
            count += pack.trained_tokens
    return {
        "eval/loss": summed / max(count, 1),
        "eval/rows": float(len(rows)),
        "eval/tokens": float(count),
        "eval/seconds": time.perf_counter() - start,
    }
