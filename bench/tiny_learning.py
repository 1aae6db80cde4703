"""Does a random-init tiny policy learn the tiny task by GRPO alone, and how fast?

Runs the real pieces in one process: HFGenerator samples, the tiny reward scores, runtime.grpo
computes advantages and the loss, TitanTrainer steps, and the generator loads the trainer's HF
weights after every step (what weight sync does between actors; `--lag 1` makes the generator
sample from the policy one version behind, as the pipeline with max_policy_age=1 may). Prints
reward vs step and seconds and a per-step time breakdown; `--out` writes them as JSON.

    .venv/bin/python bench/tiny_learning.py --out bench/results/tiny_learning.json

The defaults are the `tiny` recipe's settings. What the sweeps behind them showed (2-layer,
dim-64 model, group 8): a vocabulary of just the tokenizer's 13 ids learns twice as fast as 64
(a random policy spends its mass on ids the task never uses), and the 14th, <unk>, costs
nothing measurable (steps to a mean reward of 0.8, seeds 0-7: 28-35 with 13 ids, 27-36 with
14, `--vocab 13` against the default); 32 prompts per step reach a mean
reward of 0.8 in about 30 steps where 16 need about 47 (fewer, larger steps win when each step
also pays the pipeline's fixed overhead); lr 5e-3 was the most consistent across seeds (1e-2 is
faster on some seeds and wobbles on others); per-position credit (instead of prefix credit) lets
the policy collapse onto constant digits first and learns far slower.

With --lora-rank (the `tiny-lora` recipe) only an adapter trains, on the frozen random base, and
the frozen tied head is the limit: its rows have norm ~0.16 and the final norm fixes the hidden
state's, so at temperature 1 no hidden state gives one digit more than ~0.22 of the probability
and no lr (1e-2 .. 1e-1), rank (8 .. 64) or alpha (rank .. 4 x rank) lifts the mean reward
over 5 steps above ~0.12. Sampling at temperature 0.2 raises that bound to ~0.98; there rank 16,
alpha 32, lr 7e-3 decaying linearly over 150 steps reaches 0.8 on seeds 0-7 (bench/results/tiny_lora_learning.json; the sweep behind
it: bench/results/tiny_lora_sweep.json):

    .venv/bin/python bench/tiny_learning.py --lora-rank 16 --lr 7e-3 --temperature 0.2 \\
        --lr-schedule linear --steps 150 --seed 0-7 --out bench/results/tiny_lora_learning.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import runtime.tasks.tiny as tiny
from recipes.names import ALL_LINEAR, LOSSES
from recipes.run_sections import Lora
from runtime.backends import HFGenerator, OptimizerConfig, TitanReference, TitanTrainer, collate
from runtime.grpo import group_advantages, policy_loss
from runtime.models import ModelSpec, to_hf
from runtime.models.loading import SeededWeights
from runtime.tasks.tiny.task import TinyTask


def _values(kind: type) -> Any:
    """An argparse type: one value or a comma-separated list of them (a sweep's axis)."""
    return lambda text: [kind(v) for v in text.split(",")]


def _seeds(text: str) -> list[int]:
    """`3`, `0,4` or `0-7`."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(v) for v in text.split(",")]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--lr", type=_values(float), default=[5e-3])
    p.add_argument(
        "--lr-schedule", default="constant", choices=("constant", "linear"),
        help="linear: decay to 0 at --steps (the recipes' lr_schedule)",
    )  # fmt: skip
    p.add_argument("--temperature", type=_values(float), default=[1.0])
    p.add_argument("--max-tokens", type=int, default=3, help="max response tokens")
    p.add_argument("--kl-beta", type=float, default=0.0)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--loss", default="grpo", choices=LOSSES)
    p.add_argument("--lag", type=int, default=0, help="policy versions the generator lags")
    p.add_argument("--directions", default="up", help="tiny task directions: up or up,down")
    p.add_argument("--vocab", type=int, default=None, help="model vocab (default: tokenizer's)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--seed", type=_seeds, default=[0], help="3, 0,4 or 0-7")
    p.add_argument(
        "--lora-rank", type=_values(int), default=[0],
        help="train a LoRA adapter of this rank on the frozen random base (0: every parameter)",
    )  # fmt: skip
    p.add_argument(
        "--lora-alpha", type=_values(float), default=[0.0],
        help="the adapter's alpha (0: 2 x rank)",
    )  # fmt: skip
    p.add_argument(
        "--lora-targets", default=ALL_LINEAR,
        help=f"comma-separated HF projections (q_proj,v_proj) or {ALL_LINEAR}",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 = one per pipeline process)"
    )
    p.add_argument("--target", type=float, default=0.8, help="mean reward to report reaching")
    p.add_argument("--out", default=None, help="write the curves and breakdown as JSON here")
    return p.parse_args()


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a sweep: the settings the comma-separated options vary."""

    lr: float
    temperature: float
    lora_rank: int
    lora_alpha: float
    seed: int


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    points = [
        Point(*values)
        for values in itertools.product(
            args.lr, args.temperature, args.lora_rank, args.lora_alpha, args.seed
        )
    ]
    runs = []
    for point in points:
        if len(points) > 1:
            print(f"--- {point}", flush=True)
        runs.append(run(args, point, verbose=len(points) == 1))
    if len(points) > 1:
        print(summary_table(runs, args.target))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        from cpu_step_breakdown import device, versions

        record = {
            "args": vars(args),
            "device": device(),
            "versions": versions(),
            "threads": torch.get_num_threads(),
            "summary": summary(runs),
            "runs": runs,
        }
        Path(args.out).write_text(dumps(record) + "\n")


def model_spec(args: argparse.Namespace, vocab: int) -> ModelSpec:
    return ModelSpec(
        family="qwen3",
        vocab_size=args.vocab or vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn_dim=args.ffn,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        max_seq_len=64,
        tie_embeddings=True,
    )


def run(args: argparse.Namespace, point: Point, verbose: bool) -> dict[str, Any]:
    """Train from the seeded random init at `point`; its curve, the step the mean reward of 5
    steps reached `args.target` (or None), and a per-step time breakdown."""
    task = TinyTask(directions=tuple(args.directions.split(",")))
    tokenizer = tiny.tokenizer()
    spec = model_spec(args, len(tokenizer))
    lora = None
    if point.lora_rank:
        targets = args.lora_targets
        lora = Lora(
            rank=point.lora_rank,
            alpha=point.lora_alpha or None,
            targets=targets if targets == ALL_LINEAR else targets.split(","),
        )
    optim = OptimizerConfig(lr=point.lr, schedule=args.lr_schedule, total_steps=args.steps)
    trainer = TitanTrainer(spec, optim, temperature=point.temperature, seed=point.seed, lora=lora)
    reference = None
    if args.kl_beta and lora is None:
        reference = TitanReference(spec, temperature=point.temperature, seed=point.seed)
    # Under LoRA the generator loads the frozen base itself (the seeded init, as the trainer
    # builds it: runtime/backends/build.py::lora_base) and every version is the adapter alone.
    base = to_hf(SeededWeights(spec, point.seed).state_dict(), spec) if lora else None
    generator = HFGenerator(
        spec,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        weights=base,
        seed=point.seed,
        lora=lora,
    )
    generator.load_weights(trainer.hf_state_dict())
    stream = task.prompts(seed=point.seed)

    published: list[tuple[int, dict[str, torch.Tensor]]] = []
    phases: dict[str, list[float]] = {
        k: [] for k in ("generate", "reward", "reference", "train", "sync")
    }
    curve: list[dict[str, float]] = []
    reached = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        pairs = [next(stream) for _ in range(args.prompts)]
        ids = [tokenizer(prompt)["input_ids"] for prompt, _ in pairs]

        t0 = time.perf_counter()
        completions = generator.generate(
            ids, n=args.group, max_new_tokens=args.max_tokens, temperature=point.temperature
        )
        t1 = time.perf_counter()
        texts = tokenizer.batch_decode(
            [c.response_ids for c in completions], skip_special_tokens=True
        )
        rewards = torch.tensor(
            [
                tiny.tiny_reward(pairs[c.prompt_index][0], text, pairs[c.prompt_index][1])
                for c, text in zip(completions, texts, strict=True)
            ]
        )
        advantages = group_advantages(rewards, args.group)
        batch = collate(completions, pad_id=tokenizer.pad_token_id)
        t2 = time.perf_counter()
        ref = None
        if reference is not None:
            ref = reference.logprobs(batch.tokens, batch.response_mask)
        elif args.kl_beta:  # LoRA: the base with the adapter off, in the trainer
            ref = trainer.reference_logprobs(batch.tokens, batch.response_mask)
        t3 = time.perf_counter()
        stats = trainer.train_step(
            batch.tokens,
            batch.response_mask,
            advantages,
            batch.logprobs,
            ref,
            policy_loss,
            variant=args.loss,
            clip_low=args.clip_low,
            clip_high=args.clip_high,
            kl_beta=args.kl_beta,
            max_response_tokens=args.max_tokens,
        )
        t4 = time.perf_counter()
        # hf_state_dict() shares storage with the live parameters: keep copies while lagging.
        weights = trainer.hf_state_dict()
        if args.lag:
            weights = {k: v.clone() for k, v in weights.items()}
        published.append((trainer.step, weights))
        if len(published) > args.lag:
            version, weights = published.pop(0)
            generator.load_weights(weights)
            generator.policy_version = version
        t5 = time.perf_counter()
        for name, a, b in (
            ("generate", t0, t1),
            ("reward", t1, t2),
            ("reference", t2, t3),
            ("train", t3, t4),
            ("sync", t4, t5),
        ):
            phases[name].append(b - a)

        mean_reward = rewards.mean().item()
        elapsed = t5 - start
        curve.append(
            {
                "step": step,
                "seconds": round(elapsed, 2),
                "reward": round(mean_reward, 4),
                "kl": round(stats.get("kl", 0.0), 5),
                "grad_norm": round(stats["grad_norm"], 4),
            }
        )
        if verbose and (step == 1 or step % 5 == 0):
            prompt, answer = pairs[0]
            print(
                f"step {step:4d}  t={elapsed:6.1f}s  reward={mean_reward:.3f}  "
                f"grad_norm={stats['grad_norm']:.3f}  {prompt} -> {texts[0]!r} (want {answer})",
                flush=True,
            )
        recent = [c["reward"] for c in curve[-5:]]
        if reached is None and len(recent) == 5 and statistics.mean(recent) >= args.target:
            reached = {"step": step, "seconds": round(elapsed, 2)}
            print(
                f"mean reward of the last 5 steps >= {args.target} at step {step}, {elapsed:.1f}s"
            )

    breakdown = {k: round(1000 * statistics.mean(v), 1) for k, v in phases.items()}
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    rewards = [c["reward"] for c in curve]
    print(
        f"reached {reached}  first 3: {statistics.mean(rewards[:3]):.3f}  "
        f"last 5: {statistics.mean(rewards[-5:]):.3f}  per-step ms: {breakdown}  "
        f"params: {spec.num_params()}  trainable: {trainable}",
        flush=True,
    )
    return {
        **dataclasses.asdict(point),
        "spec": dataclasses.asdict(spec),
        "trainable_params": trainable,
        "reached": reached,
        "first3": round(statistics.mean(rewards[:3]), 4),
        "last5": round(statistics.mean(rewards[-5:]), 4),
        # the plateau where a run never reaches the target
        "best5": round(
            max(statistics.mean(rewards[i : i + 5]) for i in range(len(rewards) - 4)), 4
        ),
        "per_step_ms": breakdown,
        "curve": {key: [c[key] for c in curve] for key in curve[0]},
    }


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting (every Point field but the seed): the step each seed reached the target at
    (None: not within the run), and the mean reward of its first 3 and last 5 steps."""
    settings: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        key = tuple(r[f.name] for f in dataclasses.fields(Point) if f.name != "seed")
        settings.setdefault(key, []).append(r)
    out = []
    for key, group in settings.items():
        names = [f.name for f in dataclasses.fields(Point) if f.name != "seed"]
        steps = [(r["reached"] or {}).get("step") for r in group]
        out.append(
            {
                **dict(zip(names, key, strict=True)),
                "seeds": [r["seed"] for r in group],
                "steps_to_target": steps,
                "reached": sum(s is not None for s in steps),
                "first3": [r["first3"] for r in group],
                "last5": [r["last5"] for r in group],
                "best5": [r["best5"] for r in group],
                "min_last5": min(r["last5"] for r in group),
                "max_first3": max(r["first3"] for r in group),
            }
        )
    return out


def dumps(value: Any, indent: str = "") -> str:
    """JSON with one key a line, lists of numbers on one line (a curve stays readable)."""
    if isinstance(value, dict) and value:
        inner = indent + " "
        items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        inner = indent + " "
        return "[\n" + ",\n".join(inner + dumps(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value)


def summary_table(runs: list[dict[str, Any]], target: float) -> str:
    lines = [
        f"steps to a mean reward of {target} (-: not reached); the lowest last-5 mean, "
        "the highest mean over any 5 steps, the highest first-3 mean"
    ]
    for row in summary(runs):
        steps = " ".join("-" if s is None else str(s) for s in row["steps_to_target"])
        lines.append(
            f"lr={row['lr']:g} T={row['temperature']:g} rank={row['lora_rank']} "
            f"alpha={row['lora_alpha']:g}: {row['reached']}/{len(row['seeds'])} [{steps}]  "
            f"last5>={row['min_last5']:.3f}  best5<={max(row['best5']):.3f}  "
            f"first3<={row['max_first3']:.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
