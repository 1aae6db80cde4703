"""How long a GRPO step takes on a layout: the planner's cost model.

The planner compares the layouts that fit a GPU count (services on GPUs of their own, or sharing
them and taking turns) by the step time this module predicts, and `forgesky plan --explain`
shows every candidate with its prediction.

A step's work, per service, from the recipe's lengths (the maxima unless the caller knows the
real ones) and measured speeds (recipes/measured.py, written from committed GPU runs):

- generate: a replica's completion tokens a step over its tokens/s. Tokens/s are measured for a
  TP1 replica at a number of sequences per call; they grow with the call's sequences as
  sequences^batch_exponent (more sequences share each weight read) and, across model sizes,
  fall as params^-size_exponent. A TP group of t GPUs splits the weights each decode step
  reads (their bf16 bytes over the GPU's bandwidth, a share of the step the TP1 speed gives)
  and leaves the rest of the step as it was, and it counts as at most t^0.5 replicas (assumed:
  the communication TP adds); `tp_replicas`.
- reference: a step's sequence tokens (prompt + completion) over its tokens/s per GPU and GPUs.
- train: the same tokens over the trainer's tokens/s per GPU and GPUs; x 4/3 with activation
  checkpointing where the measurement had none (one more forward), x 3/4 the other way.
  Across sizes, both scale as 1/params (the same share of the GPU's peak).
- weight sync: the bf16 weights' GB times the seconds a GB of the path the generators take; on
  the trainer's side (publish) and on each generator's (load).

A LoRA run (`model.lora`) is predicted from the same measurements with the factors of
MEASURED["lora"], from a LoRA run of a measured model on the same GPU type against that model's
full-parameter speeds: generation through vLLM's LoRA kernels at a share of the tokens/s,
training (a forward and the input gradients, no weight gradients of the base) and the reference
(the base with the adapter off, scored by the trainer's processes, on the trainer's GPUs, in the
trainer's turn) at shares of the seconds; a version is the adapter (its bf16 GB over the path)
plus the generator's measured load of it.

Across GPU types: an unmeasured type takes a measured one's speeds with generation scaled by
the ratio of memory bandwidths (decoding reads every weight for every token) and training and
scoring by the ratio of dense bf16 peaks (the H100 and H200 have the same).

Services that share a GPU take turns on it (runtime/control/turns.py): their work on that GPU
adds up, and units that share no GPU work at once. Services overlap when a generate call may
start before the steps of the last one are trained (slack = grpo.max_policy_age + 1 -
grpo.steps_per_call > 0): the step takes as long as the busiest GPU, and at least what the
staleness bound lets through (`staleness_chain`): a call waits for the version its last step
may be at most max_policy_age behind, so a call's generate and reference and the training of
the steps it waits for run one after another (with one step a call and max_policy_age 1, half
of generate + reference + train + sync a step). With no slack (lock-step, or a call of
max_policy_age + 1 steps) nothing overlaps: the step is generate + reference + train + sync
(the replicas generate at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from recipes.gpus import GPUS
from recipes.lora import adapter_params
from recipes.measured import MEASURED
from recipes.placements import gpu_units

# Spec sheets (recipes/gpus.py): HBM bandwidth (TB/s) and dense bf16 peak (TFLOP/s).
BANDWIDTH_TBS = {k: g.bandwidth_tbs for k, g in GPUS.items()}
PEAK_BF16_TFLOPS = {k: g.bf16_tflops for k, g in GPUS.items()}
TP_EXPONENT = 0.5
CHECKPOINTING_COST = 4 / 3


@dataclass(frozen=True)
class Speeds:
    """One model's speeds on one GPU type, and where they come from."""

    generate_tok_s: float  # one TP1 replica, at `sequences_per_call`
    sequences_per_call: int
    train_tok_s: float  # per GPU
    train_checkpointing: bool
    reference_tok_s: float  # per GPU
    basis: str


@dataclass(frozen=True)
class StepEstimate:
    seconds: float
    busy: dict[str, float]  # seconds a step, per GPU group ("generator0 + trainer", ...)
    work: dict[str, float]  # seconds a step, per service (generate, reference, train, sync)
    bound_by: str  # the busiest group
    basis: str


def speeds(accelerator: str, arch: Any) -> Speeds:
    """The measured speeds nearest to `arch` on `accelerator` (the same model where measured,
    else the same family's nearest size, else any family's), scaled as the module says."""
    table = MEASURED["rates"]
    gpu = accelerator if accelerator in table else next(iter(sorted(table)))
    rates = table[gpu]
    name = f"{arch.family}-{arch.size}"
    if name in rates:
        key = name
    else:
        same = [k for k in rates if k.startswith(f"{arch.family}-")] or list(rates)
        key = min(same, key=lambda k: abs(math.log(rates[k]["params"] / arch.params)))
    r = rates[key]
    size = r["params"] / arch.params
    gen = r["generate_tok_s"] * size ** MEASURED["size_exponent"]
    train, ref = r["train_tok_s"] * size, r["reference_tok_s"] * size
    basis = f"{gpu} {key} (measured)"
    if key != name:
        size = f"{arch.params / 1e9:.1f}B" if arch.params >= 1e8 else f"{arch.params / 1e6:.1f}M"
        basis = f"{gpu} {key}, scaled to {size} parameters"
    if gpu != accelerator:
        gen *= BANDWIDTH_TBS[accelerator] / BANDWIDTH_TBS[gpu]
        compute = PEAK_BF16_TFLOPS[accelerator] / PEAK_BF16_TFLOPS[gpu]
        train, ref = train * compute, ref * compute
        basis += f", scaled to {accelerator} by memory bandwidth and bf16 peak"
    return Speeds(
        generate_tok_s=gen,
        sequences_per_call=r["sequences_per_call"],
        train_tok_s=train,
        train_checkpointing=bool(r["train_checkpointing"]),
        reference_tok_s=ref,
        basis=basis,
    )


def _sync_path(path: str) -> dict[str, Any]:
    return MEASURED["sync"][path]


def sync_seconds(arch: Any, transports: tuple[str, ...], lora: Any = None) -> float:
    """Seconds a version takes to reach the generators: the slowest path they take
    (`push_groups`: the push a group at a time); with `lora` a version is the adapter, and
    each generator loads it."""
    if lora is None:
        gb = 2 * arch.params / 1e9
        return max((gb * _sync_path(path)["s_per_gb"] for path in transports), default=0.0)
    gb = 2 * adapter_params(arch, lora) / 1e9
    slowest = max((gb * _sync_path(path)["s_per_gb"] for path in transports), default=0.0)
    return slowest + (MEASURED["lora"]["load_s"] if transports else 0.0)


def ranking_lengths(recipe: Any) -> tuple[int, int]:
    """The mean prompt and completion lengths plans weigh layouts and price steps at: the
    dataset's stated means (`dataset.prompt_tokens_mean`, `dataset.response_tokens_mean`), each
    else the most it may take (a reasoning model on math runs its completions to the limit)."""
    g, d = recipe.grpo, recipe.dataset
    return (
        d.prompt_tokens_mean or g.max_prompt_tokens,
        d.response_tokens_mean or g.max_response_tokens,
    )


def ranking_words(recipe: Any) -> str:
    """`ranking_lengths` in words, for plans and notes."""
    prompt, response = ranking_lengths(recipe)
    d = recipe.dataset
    if not d.prompt_tokens_mean and not d.response_tokens_mean:
        return f"the recipe's maximum lengths ({prompt} + {response})"
    said = "dataset.prompt_tokens_mean" if d.prompt_tokens_mean else "the most a prompt may take"
    if d.response_tokens_mean:
        return (
            f"{prompt}-token prompts ({said}) and {response}-token completions "
            "(dataset.response_tokens_mean)"
        )
    return f"{prompt}-token prompts ({said}) and {response}-token completions"


def predict_step(
    recipe: Any,
    accelerator: str,
    placements: tuple[Any, ...],
    *,
    trainer_checkpointing: bool,
    transports: tuple[str, ...],
    prompt_tokens: float | None = None,
    response_tokens: float | None = None,
) -> StepEstimate:
    """A step's seconds on `placements` (see the module docstring). `transports`: the weight
    path of each generator replica; `prompt_tokens` and `response_tokens`: a sequence's mean
    lengths (default: `ranking_lengths`)."""
    arch, g = recipe.arch, recipe.grpo
    s = speeds(accelerator, arch)
    prompt, response = ranking_lengths(recipe)
    prompt = prompt if prompt_tokens is None else prompt_tokens
    response = response if response_tokens is None else response_tokens
    sequences = g.prompts_per_step * g.group_size
    gens = [p for p in placements if p.service == "generator"]
    ref = [p for p in placements if p.service == "reference" and p.gpus]
    trainer = next(p for p in placements if p.service == "trainer")
    lora = recipe.model.lora
    sync = sync_seconds(arch, transports, lora)

    per_replica = sequences / len(gens)
    per_call = per_replica * g.steps_per_call
    tp = len(gens[0].gpus) or 1
    tok_s = s.generate_tok_s * (per_call / s.sequences_per_call) ** MEASURED["batch_exponent"]
    if lora is not None:
        tok_s *= MEASURED["lora"]["generate_share"]
    generate = (
        per_replica * response / (tok_s * tp_replicas(tp, accelerator, arch, tok_s, per_call))
    )
    tokens = sequences * (prompt + response)
    train = tokens / (s.train_tok_s * len(trainer.gpus))
    if trainer_checkpointing != s.train_checkpointing:
        train *= CHECKPOINTING_COST if trainer_checkpointing else 1 / CHECKPOINTING_COST
    if lora is not None:
        train *= MEASURED["lora"]["train_time_share"]
    reference = tokens / (s.reference_tok_s * len(ref[0].gpus)) if ref else 0.0
    in_trainer = recipe.layout.reference.in_trainer
    if in_trainer:  # scored by the trainer's ranks, in its turn
        reference = tokens / (s.reference_tok_s * max(len(trainer.gpus), 1))
        if lora is not None:
            reference *= MEASURED["lora"]["reference_time_share"]
    work = {"generate": generate, "reference": reference, "train": train, "sync": sync}

    units = {f"generator{p.replica}": generate + sync for p in gens}
    units["trainer"] = train + sync + (reference if in_trainer else 0.0)
    if ref:
        units["reference"] = reference
    # Turns are per GPU (runtime/control/turns.py): a GPU is busy for the work of every unit on
    # it, and the busiest GPU bounds the step.
    on_gpu = gpu_units(p for p in placements if p.gpus and p.service != "reward")
    busy = {
        " + ".join(sorted(group)): sum(units[u] for u in sorted(group)) for group in on_gpu.values()
    }
    k = g.steps_per_call
    slack = g.max_policy_age + 1 - k
    bound, seconds = max(busy.items(), key=lambda item: item[1])
    if slack <= 0:
        seconds = generate + reference + train + sync
        bound = "no overlap (grpo.max_policy_age + 1 = steps_per_call): all four in turn"
    else:
        chain, wait = staleness_chain(k, slack, generate, reference, train + sync)
        if chain > seconds:
            seconds, bound = chain, wait

    basis = s.basis
    notes = {_sync_path(path)["note"] for path in transports} - {""}
    if notes:
        paths = "/".join(sorted({p.removesuffix("_groups") for p in transports}))
        basis += f"; weight sync by {paths}: {'; '.join(sorted(notes))}"
    return StepEstimate(seconds, busy, work, bound, basis)


def predict_sft_step(recipe: Any, accelerator: str, gpus: int, checkpointing: bool) -> StepEstimate:
    """An SFT step's seconds: sft.tokens_per_step trained at the trainer's measured tokens/s a
    GPU (the GRPO runs' training rate, the same forward and backward), at the planned
    activation checkpointing, a LoRA adapter's share where the recipe has one."""
    s = speeds(accelerator, recipe.arch)
    train = recipe.sft.tokens_per_step / (s.train_tok_s * gpus)
    if checkpointing != s.train_checkpointing:
        train *= CHECKPOINTING_COST if checkpointing else 1 / CHECKPOINTING_COST
    if recipe.model.lora is not None:
        train *= MEASURED["lora"]["train_time_share"]
    return StepEstimate(train, {"trainer": train}, {"train": train}, "trainer", s.basis)


def sft_eval_seconds(recipe: Any, accelerator: str, gpus: int) -> float:
    """One held-out loss: eval.rows rows of at most dataset.max_tokens tokens, forward only at
    the reference's measured rate."""
    s = speeds(accelerator, recipe.arch)
    return recipe.eval.rows * recipe.dataset.max_tokens / (s.reference_tok_s * gpus)


def tp_replicas(tp: int, accelerator: str, arch: Any, tok_s: float, sequences: float) -> float:
    """How many TP1 replicas a TP group of `tp` GPUs samples as, for a call of `sequences`
    that one TP1 replica samples at `tok_s`. A decode step takes sequences / tok_s seconds, of
    which reading the bf16 weights takes their bytes over the GPU's bandwidth; TP splits that
    share over the group and leaves the rest (attention over each sequence's cache, sampling,
    the engine's own work) as it was; and the group counts as no more than tp^TP_EXPONENT
    replicas, for the communication it adds. A 1.7B model's weights are a seventh of a
    128-sequence step on an H200, so TP2 samples 1.08x as fast as TP1 (measured: 1.07x)."""
    if tp <= 1:
        return 1.0
    step = sequences / tok_s
    read = min(2 * arch.params / (BANDWIDTH_TBS[accelerator] * 1e12) / step, 1.0)
    return min(tp**TP_EXPONENT, 1 / (read / tp + 1 - read))


# how a prediction that the staleness bound sets begins (its `bound`)
STALENESS_BOUND = "max_policy_age:"


def staleness_chain(
    k: int, slack: int, generate: float, reference: float, train: float
) -> tuple[float, str]:
    """The step's seconds the staleness bound allows, and why (per-step `generate`,
    `reference` and `train`, the last with its sync). A call of k steps samples with the newest
    version; its last step may train on samples at most max_policy_age = k + slack - 1 versions
    old, so the call may start only once the trainer has made the version k - 1 - max_policy_age
    steps past its first step. Counting in calls: the call m = ceil((slack + 1) / k) calls after
    a call c waits for c's k steps to be sampled and scored and for m k - slack of them to be
    trained, and in those seconds the loop advances m k steps. With k = 1 and max_policy_age 1
    (m = 2) a step is at least half of generate + reference + train: each call waits for the
    step before the one it samples for."""
    m = -(-(slack + 1) // k)
    trained = m * k - slack
    seconds = (k * (generate + reference) + trained * train) / (m * k)
    if m == 1:
        return seconds, f"a call of {k} steps waits for {trained} of them to train"
    return (
        seconds,
        f"{STALENESS_BOUND} a call starts once the step {slack + 1} before it has trained",
    )


def eval_seconds(recipe: Any, accelerator: str, placements: tuple[Any, ...]) -> float:
    """One evaluation's seconds: eval.prompts x eval.samples_drawn completions of the longest
    length, sampled by the generator replicas at once (the speeds `predict_step` uses; greedy
    and sampled completions are counted alike)."""
    e, g = recipe.eval, recipe.grpo
    gens = [p for p in placements if p.service == "generator"]
    if not gens:
        return 0.0
    s = speeds(accelerator, recipe.arch)
    per_replica = e.prompts * (e.samples_drawn + (1 if e.samples_drawn > 1 else 0)) / len(gens)
    tok_s = s.generate_tok_s * (per_replica / s.sequences_per_call) ** MEASURED["batch_exponent"]
    tp = len(gens[0].gpus) or 1
    replicas = tp_replicas(tp, accelerator, recipe.arch, tok_s, per_replica)
    return per_replica * g.max_response_tokens / (tok_s * replicas)
