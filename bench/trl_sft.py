"""TRL's SFTTrainer on the model and chats of bench/gpu_sft.py: the SFT baseline beside
forgesky's `python -m runtime` on the same recipe, data, lengths and GPU.

    python bench/trl_sft.py [--recipe qwen3-1.7b-sft] [--steps 5] [--warmup 2] [--out FILE]
        [--section NAME] [--micro-batch N] [--gradient-checkpointing on|off] [--attention sdpa]
        [--fsdp on|off]
    python bench/trl_sft.py --dry-cpu     # the CPU check: real TRL, tiny-sft's shapes

On the GPU machine: `bash scripts/gpu/device_run.sh pairs sft` (scripts/gpu/README.md). TRL as
its documentation tunes SFT for speed:

- packing (`packing=True`, best-fit decreasing, TRL's default strategy) into sequences of the
  recipe's `dataset.max_tokens` (2,048), which makes the batches padding-free: each micro-batch
  is its packed sequences end to end, rows kept apart by position ids. TRL's docs pair this
  with FlashAttention; the GPU machine has neither flash-attn nor the Hub (the `kernels`
  route), so the attention is PyTorch's SDPA (`--attention`), where transformers turns the
  position ids into a block-diagonal mask (no attention across rows; forgesky's trainer uses
  SDPA with the same kind of mask). The JSON's `packed_row_logit_diff` checks it on the loaded
  model: a row packed after another against the row alone (about 0 where rows are kept apart);
- no gradient checkpointing (`--gradient-checkpointing off`, where memory allows: an H200);
- DDP over the processes, or with `--fsdp on` FSDP2 through accelerate, the way TRL's docs take
  a model whose whole fp32 copy and AdamW state do not fit one GPU (qwen3-8b-sft); the JSON says
  which ran (`fsdp`, `wrapped_as`);
- bf16 autocast over fp32 weights (TRL's default load, as forgesky's fp32 trainer state), loss on
  the assistant's tokens only (`assistant_only_loss`, the chat template's generation markers);
- the same tokens per optimizer step as the recipe's plan: `--micro-batch` packed sequences a
  micro-batch (default: the plan's micro-batch tokens / max_tokens, 8 on one H200) x gradient
  accumulation = `sft.tokens_per_step` / max_tokens sequences (128 for qwen3-1.7b-sft);
- the recipe's learning rate and linear schedule, AdamW (transformers' default, fused on GPUs).

Step time is the wall time between consecutive `on_step_end` callbacks (the first from
`on_train_begin`); tokens of a step are the input ids of its micro-batches (no padding in a
padding-free batch), counted in each process as they go in without a device sync, then summed
over the processes after the run (`tokens_per_step`; each process's in
`tokens_per_step_by_process`). tokens/s per GPU = the tokens of the steps after the first
`--warmup` / their seconds / processes; MFU with the runtime's
formula (runtime.sft.run.step_flops: 6 x parameters x tokens + each row's causal attention, the
rows' mean from the data) over the GPU's bf16 peak (recipes/costs.py).

Before 2026-11-30 the counts were one process's (rank 0's) and were still divided by the
processes, which halved TRL's tokens/s on two GPUs. `--count-tokens` (run under torchrun on a
CPU, no training) replays each process's micro-batches of each step from the same SFTTrainer's
own dataloader, and `--sum-processes RAW --tokens REPLAY --out FILE` writes such a run's JSON
again with the replayed counts summed (refused unless rank 0's replay equals what rank 0
counted in the run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_sft import DRY_RECIPE, bench_recipe, default_work, fail, merge, prepare  # noqa: E402


def versions() -> dict[str, str]:
    from gpu_grpo import versions as installed

    return installed(("torch", "trl", "transformers", "accelerate", "datasets"))


def planned_micro_tokens(recipe: Any, gpus: int, dry: bool) -> int:
    """The micro-batch tokens forgesky's plan gives `recipe` on `gpus` GPUs of this machine."""
    from recipes import plan
    from runtime.procs.host import gpu_type
    from runtime.sft.ranks import trainer_settings
    from runtime.sft.run import micro_tokens

    if dry:
        return micro_tokens(recipe)
    p = plan(recipe, gpus, accelerator=gpu_type())
    return int(trainer_settings(recipe, p).trainer.tokens_per_micro_batch)


def settings(a: argparse.Namespace, recipe: Any, world: int) -> dict[str, Any]:
    """The SFTConfig arguments of this run (what the JSON reports, and what builds the config)."""
    length = recipe.dataset.max_tokens
    per_step = recipe.sft.tokens_per_step // length  # packed sequences an optimizer step
    if per_step % (a.micro_batch * world):
        fail(
            f"{per_step} packed sequences a step (sft.tokens_per_step / max_tokens) do not split "
            f"into micro-batches of {a.micro_batch} on {world} processes"
        )
    return dict(
        max_length=length,
        packing=True,
        packing_strategy="bfd",
        assistant_only_loss=True,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=per_step // (a.micro_batch * world),
        max_steps=a.steps,
        learning_rate=recipe.sft.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=recipe.sft.warmup_steps,
        bf16=not on_cpu(a),
        gradient_checkpointing=a.gradient_checkpointing == "on",
        # FSDP2 through accelerate (TRL's docs' way for a model whose whole copy with AdamW
        # state does not fit a GPU, as 8B on an H200): blocks wrapped by the model's
        # `_no_split_modules`, resharded after the forward
        **({"fsdp": True, "fsdp_config": {"version": 2}} if a.fsdp == "on" else {}),
        model_init_kwargs={"attn_implementation": a.attention},
        seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=on_cpu(a),
    )


def on_cpu(a: argparse.Namespace) -> bool:
    return bool(a.dry_cpu or a.count_tokens)


def every_process(counts: list[int]) -> list[list[int]]:
    """Each process's running token counts, in rank order (this one's alone outside a group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [list(counts)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(counts))
    return gathered


def summed(by_process: list[list[int]]) -> list[int]:
    """Running counts of all the processes together (each list the same length)."""
    return [sum(at) for at in zip(*by_process, strict=True)]


def increments(running: list[Any]) -> list[Any]:
    return [b - a for a, b in zip(running, running[1:], strict=False)]


def replayed_counts(trainer: Any, steps: int, accumulation: int) -> list[int]:
    """This process's running token counts at each optimizer step's end, read from the
    trainer's own dataloader in the order `train()` takes it (epoch 0), without training."""
    loader = trainer.get_train_dataloader()
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(0)
    batches = iter(loader)
    running = [0]
    for _ in range(steps):
        n = running[-1]
        for _ in range(accumulation):
            n += int(next(batches)["input_ids"].numel())
        running.append(n)
    return running


def sum_processes(raw: dict[str, Any], replay: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a pairs JSON of TRL runs that counted rank 0's tokens alone) with each TRL
    section's tokens summed over the processes from `replay` (`--count-tokens`); the run's
    step times are kept, tokens/s per GPU and MFU recomputed. Refused (SystemExit) unless
    rank 0's replayed counts are the ones the run recorded."""
    counts = [v for v in replay.values() if isinstance(v, dict) and v.get("mode") == "count_tokens"]
    if len(counts) != 1:
        fail(f"the replay holds {len(counts)} --count-tokens sections, not 1")
    by_process = counts[0]["tokens_per_step_by_process"]
    out = json.loads(json.dumps(raw))
    for name, section in out.items():
        if not (isinstance(section, dict) and section.get("system") == "trl"):
            continue
        world = section["gpus"]
        if len(by_process) != world:
            fail(f"{name}: {world} processes, the replay has {len(by_process)}")
        if "tokens_per_step_by_process" in section:
            fail(f"{name} already counts every process")
        steps = len(section["tokens_per_step"])
        if by_process[0][:steps] != section["tokens_per_step"]:
            fail(
                f"{name}: rank 0 counted {section['tokens_per_step']}, the replay "
                f"{by_process[0][:steps]}: not the same batches"
            )
        times = section["step_times_s"]
        warmup = section["warmup_steps"]
        tokens = summed([c[:steps] for c in by_process])
        per_gpu = sum(tokens[warmup:]) / sum(times[warmup:]) / world
        # MFU is tokens/s per GPU times a constant of the model and the data (mfu())
        scaled = section["mfu"] and section["mfu"] * per_gpu / section["tokens_per_s_per_gpu"]
        section.update(
            tokens_per_step_rank0=section["tokens_per_step"],
            tokens_per_step=tokens,
            tokens_per_step_by_process=[c[:steps] for c in by_process],
            tokens_per_s_per_gpu_rank0_counted=section["tokens_per_s_per_gpu"],
            tokens_per_s_per_gpu=per_gpu,
            mfu_rank0_counted=section["mfu"],
            mfu=scaled,
            tokens_summed_by="bench/trl_sft.py --sum-processes: each process's tokens a step "
            "replayed from the same SFTTrainer's dataloader (--count-tokens, CPU, "
            f"{world} processes), rank 0's equal to those the run counted",
        )
    return out


def counted(trainer: Any, into: list[int]) -> None:
    """Count each micro-batch's input ids into `into[0]` as it goes in (a shape: no sync)."""
    inner = trainer.training_step

    def step(model: Any, inputs: dict[str, Any], *rest: Any, **kw: Any) -> Any:
        into[0] += int(inputs["input_ids"].numel())
        return inner(model, inputs, *rest, **kw)

    trainer.training_step = step


def callback(tokens: list[int]) -> Any:
    import torch
    from transformers import TrainerCallback

    class StepMarks(TrainerCallback):
        """Wall-clock marks at train start and after every optimizer step, the tokens counted
        by then, and the logs."""

        def __init__(self) -> None:
            self.marks: list[float] = []
            self.tokens: list[int] = []
            self.logs: list[dict[str, Any]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks, self.tokens = [time.perf_counter()], [tokens[0]]

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the optimizer step is queued, not done
            self.marks.append(time.perf_counter())
            self.tokens.append(tokens[0])

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append({"step": state.global_step, **(logs or {})})

    return StepMarks()


def figures(marks: list[float], seen: list[int], warmup: int, world: int) -> dict[str, Any]:
    times, tokens = increments(marks), increments(seen)
    t, n = times[warmup:], tokens[warmup:]
    return {
        "steps": len(times),
        "warmup_steps": len(times) - len(t),
        "measured_steps": len(t),
        "step_times_s": [round(x, 3) for x in times],
        "tokens_per_step": tokens,
        "step_s": sum(t) / len(t) if t else None,
        "tokens_per_s_per_gpu": sum(n) / sum(t) / world if t and sum(t) else None,
    }


def mfu(recipe: Any, prepared: dict[str, Any], result: dict[str, Any], world: int) -> float | None:
    """MFU as the runtime computes it (runtime.sft.run.step_flops), per GPU, over its peak."""
    from recipes.costs import PEAK_BF16_TFLOPS
    from runtime.backends.build import model_spec
    from runtime.procs.host import gpu_type

    peak = PEAK_BF16_TFLOPS.get(gpu_type() or "")
    if not peak or not result["tokens_per_s_per_gpu"]:
        return None
    spec = model_spec(recipe)
    width = spec.n_heads * spec.head_dim
    per_token = (
        6.0 * spec.num_params()
        + 6.0 * spec.n_layers * width * prepared["data"]["attention_tokens_per_token"]
    )
    return per_token * result["tokens_per_s_per_gpu"] / (peak * 1e12)


def rows_kept_apart(model: Any) -> float:
    """The largest logit difference between a row packed after another (position ids restarting,
    no attention mask, no cache: as TRL's padding-free loss calls the model) and the row alone:
    about 0 where the attention keeps packed rows apart."""
    import torch

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randint(3, 13, (1, n), generator=gen).to(device) for n in (10, 12))
    positions = torch.cat([torch.arange(10), torch.arange(12)])[None].to(device)
    with torch.no_grad():
        packed = model(
            input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False
        ).logits[0, 10:]
        alone = model(input_ids=second, use_cache=False).logits[0]
    return float((packed.float() - alone.float()).abs().max())


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    recipe = bench_recipe(a.recipe)
    work = Path(a.work)
    start = time.perf_counter()
    made = prepare(recipe, work, a.steps, "cpu" if on_cpu(a) else "cuda")
    prepared = {"data": {k: v for k, v in made.items() if k != "model"}, "model": made["model"]}
    prepare_s = time.perf_counter() - start
    if a.micro_batch is None:
        a.micro_batch = max(
            1, planned_micro_tokens(recipe, world, on_cpu(a)) // recipe.dataset.max_tokens
        )
    rows = load_dataset("json", data_files={"train": made["data"]}, split="train")
    tries: list[dict[str, Any]] = []
    while True:
        config = settings(a, recipe, world)
        start = time.perf_counter()
        tokens = [0]
        marks = callback(tokens)
        trainer = SFTTrainer(
            model=made["model_dir"],
            args=SFTConfig(output_dir=str(work / "trl-out"), **config),
            train_dataset=rows,
            callbacks=[marks],
        )
        counted(trainer, tokens)
        init_s = time.perf_counter() - start
        if a.count_tokens:
            running = replayed_counts(trainer, a.steps, config["gradient_accumulation_steps"])
            return {
                "mode": "count_tokens",
                "recipe": a.recipe,
                "gpus": world,
                "settings": config,
                "packed_sequences": len(trainer.train_dataset),
                "tokens_per_step_by_process": [increments(c) for c in every_process(running)],
                "versions": versions(),
            }
        packed = len(trainer.train_dataset)
        apart = rows_kept_apart(trainer.model)
        start = time.perf_counter()
        oom = None
        try:
            trainer.train()
        except torch.OutOfMemoryError as e:
            if a.micro_batch == 1:
                raise
            oom = str(e).splitlines()[0][:300]
        if oom is None:
            break
        # the largest micro-batch that fits: half as many sequences, twice the accumulation
        # (freed outside the except clause, whose traceback holds the trainer)
        tries.append({"micro_batch": a.micro_batch, "error": oom})
        print(
            f"micro-batch {a.micro_batch}: out of memory; trying {a.micro_batch // 2}", flush=True
        )
        del trainer, marks
        gc.collect()
        torch.cuda.empty_cache()
        a.micro_batch //= 2
    train_s = time.perf_counter() - start
    by_process = every_process(marks.tokens)
    result = figures(marks.marks, summed(by_process), a.warmup, world)
    from gpu_grpo import gpu_info

    return {
        "system": "trl",
        "mode": "dry_cpu" if a.dry_cpu else "gpu",
        "recipe": a.recipe,
        "gpus": world,
        "settings": {k: v for k, v in config.items()},
        "attention": trainer.model.config._attn_implementation,
        # how the processes shared the model: FSDP (--fsdp on, on GPUs) or DDP; on a CPU
        # accelerate runs DDP either way
        "fsdp": bool(getattr(trainer, "is_fsdp_enabled", False)),
        "wrapped_as": type(trainer.model_wrapped).__name__,
        "padding_free": bool(getattr(trainer, "padding_free", False)),
        "packed_row_logit_diff": apart,
        "sequence_tokens": recipe.dataset.max_tokens,
        "tokens_per_optimizer_step": recipe.sft.tokens_per_step,
        "packed_sequences": packed,
        "micro_batch_tries": tries,
        "model_dtype": str(next(trainer.model.parameters()).dtype),
        **prepared,
        "prepare_s": round(prepare_s, 1),
        "init_s": round(init_s, 1),
        "train_s": round(train_s, 1),
        **result,
        "tokens_per_step_by_process": [increments(c) for c in by_process],
        "mfu": mfu(recipe, prepared, result, world),
        "loss_by_step": [x.get("loss") for x in marks.logs if "loss" in x],
        # TRL's own running count of every process's tokens: the sums above should agree
        "num_tokens_logged_by_trl": [x["num_tokens"] for x in marks.logs if "num_tokens" in x],
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
        "exit_code": 0 if result["measured_steps"] else 1,
        "versions": versions(),
        "device": gpu_info(),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="qwen3-1.7b-sft")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    p.add_argument("--out", default=None, help="JSON to merge the section into")
    p.add_argument("--section", default="sft_trl")
    p.add_argument("--work", default=None, help="model folder and data (bench/gpu_sft.py's)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="packed sequences a micro-batch (default: the plan's tokens / max_tokens)")  # fmt: skip
    p.add_argument("--gradient-checkpointing", choices=("on", "off"), default="off")
    p.add_argument("--attention", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    p.add_argument("--fsdp", choices=("on", "off"), default="off",
                   help="FSDP2 over the processes instead of DDP (a model too big for DDP)")  # fmt: skip
    p.add_argument("--dry-cpu", action="store_true", help="tiny-sft on the CPU: the code path")
    p.add_argument("--count-tokens", action="store_true",
                   help="no training: each process's tokens a step, from the trainer's dataloader")  # fmt: skip
    p.add_argument("--sum-processes", metavar="RAW", default=None,
                   help="a pairs JSON whose TRL runs counted rank 0 alone: write it again "
                   "with --tokens (a --count-tokens JSON) summed, into --out")  # fmt: skip
    p.add_argument("--tokens", metavar="REPLAY", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.sum_processes:
        if not (a.tokens and a.out):
            fail("--sum-processes needs --tokens REPLAY and --out FILE")
        raw, replay = (json.loads(Path(f).read_text()) for f in (a.sum_processes, a.tokens))
        Path(a.out).write_text(json.dumps(sum_processes(raw, replay), indent=2) + "\n")
        print(f"-> {a.out}")
        return 0
    if a.dry_cpu:
        a.recipe = DRY_RECIPE
        a.work = a.work or str(Path(tempfile.gettempdir()) / "gpu_sft_dry_cpu")
        a.out = a.out or str(Path(tempfile.gettempdir()) / "gpu_sft_dry_cpu.json")
    if a.steps <= a.warmup or a.warmup < 0:
        fail(f"--steps {a.steps} leaves no step after --warmup {a.warmup}")
    if a.micro_batch is not None and a.micro_batch < 1:
        fail(f"--micro-batch is 1 or more, not {a.micro_batch}")
    a.work = a.work or str(default_work())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(a)
    if a.out and int(os.environ.get("RANK", "0")) == 0:
        merge(Path(a.out), result, a.section)
        print(f"-> {a.out}#{a.section}")
    if a.count_tokens:
        print(f"tokens a step, by process: {result['tokens_per_step_by_process']}", flush=True)
        return 0
    print(
        f"TRL SFTTrainer {a.recipe} on {result['gpus']} process(es): "
        f"{result['tokens_per_s_per_gpu']} tokens/s per GPU, MFU {result['mfu']}, step "
        f"{result['step_s']} s over {result['measured_steps']} steps, micro-batch "
        f"{a.micro_batch} x {result['settings']['gradient_accumulation_steps']}",
        flush=True,
    )
    return int(result["exit_code"])


if __name__ == "__main__":
    raise SystemExit(main())
