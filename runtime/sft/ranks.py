"""An SFT run on the trainer actor's ranks: the GRPO runtime's trainer procs (one FSDP2 rank per
trainer GPU, on CPU gloo ranks; SDPA with a dense document mask either way) under a
run lifecycle, driven by the loop of runtime.sft.run.

The loop runs in a thread of its own, the lifecycle's event loop in the main one: each of the
loop's trainer calls is an endpoint called on every rank (`Services.train_calls`), supervised
as a GRPO run's are (a rank's failure ends the run with its cause, the watchdog's deadlines).
Every rank is given the step's packed micro-batches and trains on its share of them
(`FSDPTrainer.sft_step`); checkpoints are the actor's `save`/`saved`/`load`, resharded to the
ranks that load them, and the model folder at the end its `export`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# How often a trainer call waiting for its answer looks whether the run has failed meanwhile
WAIT_POLL_S = 1.0


@dataclass(frozen=True)
class SftSettings:
    """What the trainer actor's `setup` reads of a plan's settings: `trainer`, the planned
    recipes.settings.TrainerSettings."""

    trainer: Any


def trainer_settings(recipe: Any, plan: Any) -> SftSettings:
    """The trainer's ranks, micro-batch, activation checkpointing and compile for `plan`: on
    GPUs one rank per trainer GPU and the memory plan's micro-batch (recipes.sft.trainer_memory);
    on CPU the recipe's trainer.ranks (auto: 1) and the CPU trainer's micro-batch."""
    from recipes.settings import TrainerSettings
    from recipes.sft import planned_trainer
    from runtime.sft.run import micro_tokens

    t = recipe.trainer

    def given(value: Any, default: Any) -> Any:
        return default if value == "auto" else value

    if plan.cpu:
        return SftSettings(
            TrainerSettings(
                ranks=given(t.ranks, 1),
                tokens_per_micro_batch=micro_tokens(recipe),
                activation_checkpointing=given(t.activation_checkpointing, False),
                compile=given(t.compile, False),
                gather_once=bool(given(t.gather_once, False)) and given(t.ranks, 1) > 1,
            )
        )
    return SftSettings(planned_trainer(recipe, plan.trainer_gpus, plan.accelerator)[0])


def on_ranks(recipe: Any, plan: Any) -> bool:
    """Whether an SFT run of `plan` takes the trainer actor's ranks: on GPUs always, on CPU
    where the recipe asks for more than one rank (trainer.ranks)."""
    return not plan.cpu or recipe.trainer.ranks not in ("auto", 1)


def peak_flops(plan: Any, ranks: int) -> float | None:
    """The bf16 peak of the trainer's GPUs in all (FLOP/s), where the accelerator's is known."""
    if plan.cpu:
        return None
    from recipes.costs import PEAK_BF16_TFLOPS

    tflops = PEAK_BF16_TFLOPS.get(plan.accelerator)
    return tflops * 1e12 * ranks if tflops else None


class RankTrainer:
    """The trainer actor's ranks as the SFT loop sees a trainer: each method blocks the loop's
    thread on a supervised call of every rank made on the lifecycle's event loop."""

    # each rank counts its step's events and runs trainer.profile_step under its own profiler
    profiles_itself = True

    def __init__(self, services: Any, loop: asyncio.AbstractEventLoop):
        self.services, self.loop = services, loop
        self.step = 0

    def _wait(self, call: Awaitable[T]) -> T:
        """`call`'s answer. A failure ends the loop at its next call (the failure raised). A
        stop requested (Ctrl-C, SIGTERM) does not: the loop ends at its step boundary and
        saves its last step first (runtime.sft.run.run's `stopping`); only once the
        lifecycle's event loop is gone (the stop's grace spent) is it RunStopping."""
        from runtime.procs.lifecycle import RunStopping

        life = self.services.life
        if life.failure is not None:
            call.close()  # type: ignore[attr-defined]
            raise life.failure
        future = asyncio.run_coroutine_threadsafe(call, self.loop)  # type: ignore[arg-type]
        while True:
            try:
                return future.result(timeout=WAIT_POLL_S)
            except concurrent.futures.TimeoutError:
                if self.loop.is_closed() or life.failure is not None:
                    future.cancel()
                    raise life.failure or RunStopping() from None

    def sft_step(self, packs: list[Any]) -> dict[str, float]:
        """Rank 0's figures (the loss, grad norm and lr every rank shares) over every rank's
        (runtime.control.services.rank_figures)."""
        from runtime.control.services import rank_figures

        stats = rank_figures(self._wait(self.services.train_calls("sft_step", packs)))
        self.step = int(stats["step"])
        return stats

    def sft_loss(self, packs: list[Any]) -> tuple[float, int]:
        summed, count = self._wait(self.services.train_call("sft_loss", packs))
        return float(summed), int(count)

    def save_checkpoint(self, directory: str) -> None:
        self._wait(self.services.save(directory))

    def checkpoint_written(self, wait: bool = True) -> bool:
        return self._wait(self.services.saved(wait))

    def load_checkpoint(self, directory: str) -> None:
        self.step = int(self._wait(self.services.restore(directory)))

    def write_model(self, run_dir: Path, recipe: Any, step: int) -> Path:
        folder = run_dir / "model"
        provenance = {"recipe": recipe.name, "step": step, "run_dir": str(run_dir)}
        self._wait(self.services.export(str(folder), provenance))
        return folder


def run_on_ranks(
    recipe: Any,
    run_dir: Path,
    plan: Any,
    *,
    data: Any = None,
    wandb_mode: str = "disabled",
    checkpoint_every: int | None = None,
    log: Callable[[str], None] = print,
) -> int:
    """Train `recipe` (an SFT recipe) into `run_dir` on the trainer actor's ranks of `plan`;
    the process exit code (a failure's line said, as a GRPO run's). `data`: the recipe's,
    prepared (runtime.sft.run.prepare; default: prepared once the lifecycle runs). A stop
    (Ctrl-C, SIGTERM) ends the run at its step boundary with a checkpoint of its last step."""
    import os
    import time

    from runtime.control.startup import start_trainer_alone
    from runtime.procs.lifecycle import RunLifecycle
    from runtime.sft.run import run

    began = time.perf_counter()
    settings = trainer_settings(recipe, plan)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    async def main(life: RunLifecycle) -> None:
        loop = asyncio.get_running_loop()

        def start(r: Any) -> RankTrainer:
            log(f"starting the trainer ({settings.trainer.ranks} ranks) ...")
            startup = life.start(start_trainer_alone(life, r, plan, settings))
            return RankTrainer(asyncio.run_coroutine_threadsafe(startup, loop).result(), loop)

        await asyncio.to_thread(
            run,
            recipe,
            run_dir,
            data=data,
            stopping=life.stopping.is_set,
            wandb_mode=wandb_mode,
            checkpoint_every=checkpoint_every,
            log=log,
            start_trainer=start,
            tokens_per_micro_batch=settings.trainer.tokens_per_micro_batch,
            peak_flops=peak_flops(plan, settings.trainer.ranks),
            run_plan=plan,
            started=began,
        )

    life = RunLifecycle("forgesky")
    return asyncio.run(life.run(main))
