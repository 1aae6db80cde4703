"""SFT throughput through the product path: `python -m runtime` on an SFT recipe's plan, random
weights, synthetic chats; tokens/s per GPU and MFU read from the run's metrics.jsonl.

    python bench/gpu_sft.py [--recipe qwen3-1.7b-sft] [--gpus 1] [--steps 5] [--warmup 2]
        [--out FILE] [--section NAME] [--work DIR] [--set KEY=VALUE ...]
    python bench/gpu_sft.py --dry-cpu          # the CPU check: tiny-sft, the same code path

On the GPU machine: `bash scripts/gpu/device_run.sh pairs sft` (scripts/gpu/README.md), beside
TRL's SFTTrainer (bench/trl_sft.py), which reads the same two things this writes in `--work`:

- `model/`: a Hugging Face folder of the recipe's architecture with random bf16 weights
  (bench/product_path.py's writer) and a character tokenizer with a chat template (no Hub on the
  machine): the arith tokenizer sized to the vocabulary (Qwen3-1.7B's 151,936 ids), or the tiny
  tokenizer for the tiny CPU recipe;
- `chats.jsonl`: deterministic chat rows (a user turn, an assistant turn) whose rendered length is
  spread evenly from an eighth of `dataset.max_tokens` to all of it, none longer (nothing is
  truncated on either side), enough for the run's steps at the recipe's `sft.tokens_per_step`.

The run is the one a user starts (`forgesky local`), the recipe's plan for `--gpus` on the GPU
found (micro-batch, activation checkpointing and compile from the memory plan), with only
`--set` for the model folder, the data, no held-out evaluation (random weights), `--steps` and
no checkpoint but the last: the JSON lists these as set by hand. Figures over the steps after the
first `--warmup`: tokens/s per GPU = their tokens (every token of the packed rows, as the
runtime counts them) / their seconds / GPUs; MFU as the runtime logs it (model FLOPs, causal
attention of each row included, over the GPUs' bf16 peak). The run's folder is deleted after
(its last checkpoint is 12 bytes a parameter).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from child import run_child  # noqa: E402

# One template for both sides, char-level: <bos>, each turn's text and <eos>; the assistant's
# turn (its <eos> too) inside generation markers, which TRL's assistant-only loss reads and
# forgesky's ChatEncoder renders as plain text.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
SPECIALS = 3  # <bos> and two <eos> a row
DRY_RECIPE = "tiny-sft"
# how long a stopped run may take to shut its procs down before its session is killed
STOP_GRACE_S = 60


def fail(message: str) -> None:
    """A mistake in the arguments: one line, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def bench_recipe(name: str, sets: list[str] | None = None) -> Any:
    from recipes import apply_overrides, load_recipe

    recipe = load_recipe(name)
    if recipe.kind != "sft":
        fail(f"{name} is a {recipe.kind} recipe; this bench runs SFT recipes")
    return apply_overrides(recipe, sets) if sets else recipe


def tokenizer_for(recipe: Any) -> tuple[Any, str]:
    """The bench's tokenizer for `recipe`'s vocabulary (with CHAT_TEMPLATE) and the characters its
    chats are made of."""
    from runtime.tasks.arith.tokenization import CHARACTERS, build_tokenizer

    vocab = recipe.arch.vocab_size
    if vocab >= len(CHARACTERS) + SPECIALS:
        tok, letters = build_tokenizer(vocab), "abcdefghijklmnopqrstuvwxyz"
    else:  # the tiny CPU recipe: its own 14-id tokenizer
        from runtime.tasks.tiny import DIGITS, tokenizer

        tok, letters = tokenizer(), DIGITS
    tok.chat_template = CHAT_TEMPLATE
    return tok, letters


def text(rng: random.Random, letters: str, n: int) -> str:
    """`n` characters: words of 2-9 letters between single spaces (all letters where the
    alphabet has no space, as the tiny one)."""
    if " " in letters or len(letters) <= 10:
        return "".join(rng.choice(letters) for _ in range(n))
    out: list[str] = []
    while len(out) < n:
        out += [rng.choice(letters) for _ in range(rng.randint(2, 9))] + [" "]
    return "".join(out[: n - 1]) + rng.choice(letters)


def chats(recipe: Any, letters: str, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Chat rows of `letters`, rendered lengths spread from max_tokens/8 to max_tokens (a user
    turn of about a fifth), their tokens at least (steps + 1) steps' worth."""
    longest = recipe.dataset.max_tokens
    shortest = max(longest // 8, SPECIALS + 2)
    need = (steps + 1) * recipe.sft.tokens_per_step
    rng = random.Random(seed)
    rows, total = [], 0
    while total < need:
        n = rng.randint(shortest, longest)
        user = max(1, (n - SPECIALS) // 5)
        messages = [
            {"role": "user", "content": text(rng, letters, user)},
            {"role": "assistant", "content": text(rng, letters, n - SPECIALS - user)},
        ]
        rows.append({"messages": messages})
        total += n
    return rows


def prepare(recipe: Any, work: Path, steps: int, device: str) -> dict[str, Any]:
    """`work`/model (written once per recipe architecture) and `work`/chats.jsonl (every time:
    deterministic); what they hold."""
    from product_path import random_model_once

    tok, letters = tokenizer_for(recipe)
    rows = chats(recipe, letters, steps)
    data = work / "chats.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rendered = [tok.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    lengths = [len(ids) for ids in tok(rendered, add_special_tokens=False)["input_ids"]]
    if max(lengths) > recipe.dataset.max_tokens:
        raise AssertionError(f"a chat of {max(lengths)} tokens, over {recipe.dataset.max_tokens}")
    model = work / "model"
    written = random_model_once(recipe, model, device=device, tokenizer=tok)
    return {
        "model_dir": str(model),
        "data": str(data),
        "rows": len(rows),
        "row_tokens_min_mean_max": [min(lengths), round(statistics.mean(lengths), 1), max(lengths)],
        "tokens": sum(lengths),
        "attention_tokens_per_token": sum(n * n for n in lengths) / sum(lengths),
        "model": written,
    }


def by_hand(recipe: Any, prepared: dict[str, Any]) -> list[str]:
    """The `--set`s the run gets beyond the plan: the model folder, the data, no evaluation."""
    sets = [f"model.hf_id={prepared['model_dir']}", "model.init=hub"]
    if recipe.model.tokenizer:
        sets.append(f"model.tokenizer={prepared['model_dir']}")
    return [*sets, f"dataset.path={prepared['data']}", "eval.enabled=false"]


def command(
    a: argparse.Namespace, recipe: Any, prepared: dict[str, Any], run_dir: Path
) -> list[str]:
    cmd = [sys.executable, "-m", "runtime", "--recipe", a.recipe, "--gpus", str(a.gpus)]
    cmd += ["--run-dir", str(run_dir), "--steps", str(a.steps), "--checkpoint-every", "0"]
    for s in [*by_hand(recipe, prepared), *a.sets]:
        cmd += ["--set", s]
    return cmd


def summarize(rows: list[dict[str, Any]], warmup: int, gpus: int) -> dict[str, Any]:
    """Figures over the step records after the first `warmup`."""
    steps = [r for r in rows if "tokens_per_s" in r]
    # a step run under the profiler (trainer.profile_step) is not timed: the profiler's cost
    timed = [r for r in steps if r["step"] > warmup and not r.get("trainer/profiled")]
    seconds = sum(r["time/step_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "steps": len(steps),
        "warmup_steps": sum(r["step"] <= warmup for r in steps),
        "profiled_steps": [r["step"] for r in steps if r.get("trainer/profiled")],
        "measured_steps": len(timed),
        "step_times_s": [round(r["time/step_s"], 3) for r in steps],
        "tokens_per_step": [r["tokens"] for r in steps],
        "micro_batches_per_step": [r.get("micro_batches") for r in steps],
        "step_s": seconds / len(timed) if timed else None,
        "tokens_per_s_per_gpu": tokens / seconds / max(gpus, 1) if timed and seconds else None,
        "mfu": statistics.mean(mfus) if mfus else None,
        "mfu_by_step": [r.get("mfu") for r in steps],
        "loss_by_step": [r.get("loss") for r in steps],
        # what a slow step had that the others did not (runtime.backends.gpu_memory.StepEvents)
        "compile_graphs_by_step": [r.get("compile/graphs") for r in steps],
        # on several ranks the most any rank compiled: a rank that compiles holds the rest up
        "compile_graphs_ranks_max_by_step": [r.get("compile/ranks_max/graphs") for r in steps],
        "alloc_retries_by_step": [r.get("memory/alloc_retries") for r in steps],
        # where each step's seconds went: the trainer's own step and the data's (since 2026-11-30b)
        "train_s_by_step": [r.get("time/train_s") for r in steps],
        "data_s_by_step": [r.get("time/data_s") for r in steps],
        "memory_train_gb": max((r.get("memory/train_gb", 0.0) for r in steps), default=None),
    }


def prepared_in_child(a: argparse.Namespace) -> dict[str, Any]:
    """prepare() in a process of its own: the model writer's CUDA context ends with it, and the
    run's GPU check finds the GPU free."""
    out = Path(a.work) / "prepared.json"
    cmd = [sys.executable, __file__, "--prepare-only", "--recipe", a.recipe, "--work", a.work]
    cmd += ["--steps", str(a.steps), *(["--dry-cpu"] if a.dry_cpu else [])]
    for s in a.sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def run(a: argparse.Namespace) -> dict[str, Any]:
    from recipes import plan
    from runtime.control.metrics import read_metrics
    from runtime.procs.host import gpu_type
    from runtime.sft.ranks import on_ranks, trainer_settings

    recipe = bench_recipe(a.recipe, a.sets)
    work = Path(a.work)
    start = time.perf_counter()
    prepared = prepared_in_child(a)
    prepare_s = time.perf_counter() - start
    from gpu_grpo import gpu_info

    device = gpu_info()
    accel = None if a.dry_cpu else gpu_type()  # as `python -m runtime` picks it
    run_plan = plan(bench_recipe(a.recipe, [*by_hand(recipe, prepared), *a.sets]), a.gpus,
                    accelerator=accel)  # fmt: skip
    planned = trainer_settings(recipe, run_plan).trainer if on_ranks(recipe, run_plan) else None
    run_dir = work / f"run{a.section and '-' + a.section}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = command(a, recipe, prepared, run_dir)
    log = Path(a.log) if a.log else None
    print("running:", " ".join(cmd), flush=True)
    started = time.perf_counter()
    code = run_child(cmd, log, ROOT, STOP_GRACE_S)
    wall_s = time.perf_counter() - started
    if log:
        print("\n".join(log.read_text().splitlines()[-15:]), flush=True)
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    summary = summarize(rows, a.warmup, max(a.gpus, 1))
    # the run's own end: its measured wall time beside the plan's prediction (run_time_check.py)
    ended = run_dir / "summary.json"
    run_summary = json.loads(ended.read_text()) if ended.exists() else None
    from gpu_grpo import run_profiles

    profiles = run_profiles(run_dir)  # trainer.profile_step's summaries, where one was set
    if not a.keep_run:
        shutil.rmtree(run_dir, ignore_errors=True)
    complete = code == 0 and summary["measured_steps"] > 0
    return {
        "system": "forgesky",
        "mode": "dry_cpu" if a.dry_cpu else "gpu",
        "recipe": a.recipe,
        "gpus": a.gpus,
        "command": cmd,
        "set_by_hand": [
            *by_hand(recipe, prepared),
            *a.sets,
            f"--steps {a.steps}",
            "--checkpoint-every 0 (the last step's checkpoint only)",
        ],  # fmt: skip
        "plan": {
            "accelerator": run_plan.accelerator,
            "trainer_gpus": run_plan.trainer_gpus,
            "trainer": None
            if planned is None
            else {
                "ranks": planned.ranks,
                "tokens_per_micro_batch": planned.tokens_per_micro_batch,
                "activation_checkpointing": planned.activation_checkpointing,
                "compile": planned.compile,
                "gather_once": planned.gather_once,
            },
        },  # fmt: skip
        "sequence_tokens": recipe.dataset.max_tokens,
        "tokens_per_optimizer_step": recipe.sft.tokens_per_step,
        "data": {k: v for k, v in prepared.items() if k != "model"},
        "model": prepared["model"],
        "prepare_s": round(prepare_s, 1),
        "wall_s": round(wall_s, 1),
        "exit_code": 0 if complete else (code or 1),
        "log": str(log) if log else "the bench's own output",
        "device": device,
        **summary,
        "run_summary": run_summary,
        **({"profiles": profiles} if profiles else {}),
    }


def merge(out: Path, section: dict[str, Any], name: str) -> None:
    """`section` into `out` under `name`, with the device at the top (as gpu_grpo.py's JSON)."""
    result = json.loads(out.read_text()) if out.exists() else {}
    result[name] = section
    result.setdefault("device", section.get("device", {}))
    result.setdefault("date", time.strftime("%Y-%m-%d", time.gmtime()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def default_work() -> Path:
    """/dev/shm where it has room for a run's checkpoint, else the temporary folder."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 60e9:
        return shm / "sft-bench"
    return Path(tempfile.gettempdir()) / "sft-bench"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="qwen3-1.7b-sft")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    p.add_argument("--out", default=None, help="JSON to merge the section into")
    p.add_argument("--section", default="sft_ours")
    p.add_argument("--work", default=None, help="model folder, data, run dir (default: /dev/shm)")
    p.add_argument("--log", default=None, help="the runtime's output (default: this one's)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--keep-run", action="store_true", help="keep the run's folder")
    p.add_argument("--dry-cpu", action="store_true", help="tiny-sft on the CPU: the code path")
    p.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.dry_cpu:
        a.recipe, a.gpus = DRY_RECIPE, 0
        a.work = a.work or str(Path(tempfile.gettempdir()) / "gpu_sft_dry_cpu")
        a.out = a.out or str(Path(tempfile.gettempdir()) / "gpu_sft_dry_cpu.json")
    if a.steps <= a.warmup:
        fail(f"--steps {a.steps} leaves no step after --warmup {a.warmup}")
    if a.warmup < 0 or a.gpus < 0:
        fail("--warmup and --gpus are 0 or more")
    a.work = a.work or str(default_work())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.prepare_only:  # the child of prepared_in_child
        recipe = bench_recipe(a.recipe, a.sets)
        made = prepare(recipe, Path(a.work), a.steps, "cpu" if a.dry_cpu else "cuda")
        (Path(a.work) / "prepared.json").write_text(json.dumps(made) + "\n")
        return 0
    result = run(a)
    if a.out:
        merge(Path(a.out), result, a.section)
        print(f"-> {a.out}#{a.section}")
    print(
        f"forgesky {a.recipe} on {a.gpus} GPU(s): {result['tokens_per_s_per_gpu']} tokens/s per "
        f"GPU, MFU {result['mfu']}, step {result['step_s']} s over {result['measured_steps']} "
        f"steps, exit {result['exit_code']}",
        flush=True,
    )
    return int(result["exit_code"])


if __name__ == "__main__":
    raise SystemExit(main())
