"""The recipe: one YAML file describing a GRPO run (model, data, algorithm, layout, resources).

Field checks live on the fields; checks that span sections (tensor-parallel sizes against the
architecture, trainer ranks against its GPUs, the memory estimate against the accelerator) live
in `Recipe._check_consistency`. Every message names the dotted field path.

Placement is `layout` (which service gets how many GPUs); how each service runs is its own
section (`generator`, `trainer`, `reference`, `weight_sync`), where "auto" values are planned
from the GPU type and the layout (recipes/settings.py) and shown by `forgesky plan`.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from recipes.architectures import ARCHITECTURES, Arch, architecture, sizes
from recipes.memory import estimate_memory, memory_errors
from recipes.names import (
    BUILTIN_REWARDS,
    BUILTIN_SPLITS,
    BUILTIN_TASKS,
    FAMILIES,
    LOSS_AGGREGATION,
    LOSSES,
)

DEFAULT_PROMPT_TEMPLATE = "{question}\nThink step by step, then give the final answer after '####'."


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise PydanticCustomError("blank", "must not be blank (got '{v}')", {"v": value})
    return value


# A name the user types: a recipe, a model, a dataset, a column, a reward.
Identifier = Annotated[str, AfterValidator(_not_blank)]


def _shipped(value: str | None) -> str | None:
    """`builtin:<name>` must name a task forgesky ships; other values pass through."""
    if value is not None and value.startswith("builtin:"):
        name = value.removeprefix("builtin:")
        if name not in BUILTIN_TASKS:
            raise PydanticCustomError(
                "builtin",
                "no shipped task named '{name}' (shipped: {known})",
                {"name": name, "known": ", ".join(BUILTIN_TASKS)},
            )
    return value


class Model(_Strict):
    hf_id: Identifier
    family: Literal[FAMILIES]
    size: Identifier
    gated: bool = False
    tokenizer: Identifier | None = None
    init: Literal["hub", "random"] = "hub"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # Qwen3's thinking mode, passed to the chat template as enable_thinking: false makes the
    # template close an empty <think></think> block, so the model answers directly; null leaves
    # the template's default (Qwen3: thinking on). Llama 3 has no thinking mode.
    thinking: bool | None = None

    _builtin = field_validator("hf_id", "tokenizer")(_shipped)


class Reward(_Strict):
    name: Identifier
    weight: float = 1.0

    @field_validator("name")
    @classmethod
    def _known_form(cls, name: str) -> str:
        if name in BUILTIN_REWARDS or (":" in name and all(name.split(":", 1))):
            return _shipped(name)
        raise PydanticCustomError(
            "reward_name",
            "unknown reward '{name}'; use math, gsm8k_format, format, builtin:<name> or "
            "module:function",
            {"name": name},
        )


class Dataset(_Strict):
    path: Identifier
    config: Identifier | None = None
    split: Identifier = "train"
    prompt_field: Identifier = "question"
    answer_field: Identifier = "answer"
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    system_prompt: str | None = None
    rewards: list[Reward] = Field(min_length=1)
    # The prompts' mean length in tokens, as the generator gets them (template and chat format
    # included): plans rank their layouts at it (unset: at grpo.max_prompt_tokens, the most a
    # prompt may take). A run prints its own mean (prompt/len_mean) after a few steps.
    prompt_tokens_mean: int | None = Field(default=None, gt=0)

    _builtin = field_validator("path")(_shipped)

    @field_validator("prompt_template")
    @classmethod
    def _only_question(cls, template: str) -> str:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        except ValueError as e:
            raise PydanticCustomError(
                "template", "not a format string: {err}", {"err": str(e)}
            ) from None
        unknown = sorted(names - {"question"})
        if unknown:
            raise PydanticCustomError(
                "template",
                "unknown placeholder {{name}}; the only one is {question}",
                {"name": unknown[0]},
            )
        return template


class Grpo(_Strict):
    group_size: int = Field(ge=2)
    prompts_per_step: int = Field(ge=1)
    max_prompt_tokens: int = Field(gt=0)
    max_response_tokens: int = Field(gt=0)
    learning_rate: float = Field(gt=0)
    kl_beta: float = Field(ge=0)
    clip_low: float = Field(ge=0)
    clip_high: float = Field(ge=0)
    # a built-in (grpo, dr_grpo, dapo, gspo, cispo, sapo) or module:function of your own
    loss: Identifier
    max_policy_age: int = Field(ge=0)
    # Prompts of this many steps go to the generators in one call (fuller decode batches, for a
    # generator that would otherwise wait on its own KV cache); the call's last step is trained
    # on steps_per_call - 1 versions later, so it must be <= max_policy_age + 1.
    steps_per_call: int = Field(default=1, ge=1)
    steps: int = Field(ge=1)
    checkpoint_interval: int = Field(ge=0)
    # after a failure, how long the run waits for a checkpoint already being written to reach
    # disk and be committed before it ends (0: it ends at once and that write is lost)
    checkpoint_finish_s: float = Field(default=120.0, ge=0)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int = 0
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    # after warmup: hold the learning rate, or decay it linearly to 0 at the last step
    lr_schedule: Literal["constant", "linear"] = "constant"
    # KL to the reference: its estimator (k1, k2, k3) and where it goes: a term of the loss
    # (weight kl_beta), or subtracted from each completion's reward before advantages
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_placement: Literal["loss", "reward"] = "loss"
    # the entropy bonus: the loss less entropy_coef x the policy's entropy (0: off; the entropy
    # is a metric of every step either way)
    entropy_coef: float = Field(default=0.0, ge=0)
    # how per-token terms become one loss: auto is the loss's own (runtime/grpo/losses.py)
    aggregation: Literal["auto", "sequence_mean", "token_mean", "constant"] = "auto"
    # advantages scaled by the group's population std (mean 0, RMS 1) or its sample std
    advantage_std: Literal["population", "sample"] = "population"
    # DAPO's dynamic sampling: groups whose completions all scored alike are dropped and
    # sampling goes on until prompts_per_step informative groups are queued, drawing at most
    # dynamic_sampling_max_draws x prompts_per_step groups a step (then the rest are kept);
    # auto: on for dapo
    dynamic_sampling: bool | Literal["auto"] = "auto"
    dynamic_sampling_max_draws: int = Field(default=3, ge=1)
    # DAPO's soft overlong punishment: a completion within this many tokens of
    # max_response_tokens loses up to 1 (linearly), one that ran into the limit 1; auto: a
    # quarter of max_response_tokens for dapo, else 0 (off)
    overlong_buffer_tokens: int | Literal["auto"] = "auto"
    # DAPO's overlong filtering: completions cut at max_response_tokens carry no loss
    mask_truncated: bool = False
    # SAPO's gate temperatures (positive and negative advantages)
    sapo_tau_pos: float = Field(default=1.0, gt=0)
    sapo_tau_neg: float = Field(default=1.05, gt=0)

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        if name in LOSSES or (":" in name and all(name.split(":", 1))):
            return name
        raise PydanticCustomError(
            "loss_name",
            "unknown loss '{name}'; use {known} or module:function",
            {"name": name, "known": ", ".join(LOSSES)},
        )

    @property
    def aggregation_mode(self) -> str:
        """The aggregation the loss runs with ("auto" resolved; module:function losses take
        sequence_mean)."""
        if self.aggregation != "auto":
            return self.aggregation
        return LOSS_AGGREGATION.get(self.loss, "sequence_mean")

    @property
    def uses_dynamic_sampling(self) -> bool:
        return self.loss == "dapo" if self.dynamic_sampling == "auto" else self.dynamic_sampling

    @property
    def overlong_buffer(self) -> int:
        """Tokens of soft overlong punishment before max_response_tokens (0: none)."""
        if self.overlong_buffer_tokens != "auto":
            return self.overlong_buffer_tokens
        return self.max_response_tokens // 4 if self.loss == "dapo" else 0


class Eval(_Strict):
    """Evaluation on held-out prompts, on the generators, during training and at its end."""

    enabled: bool = False
    # the held-out split of the dataset section's data (its columns and template); builtin
    # tasks have "test"; `path` names other data instead (a held-out file, say)
    split: Identifier = "test"
    path: Identifier | None = None
    # the first this many prompts of the split, in its order (the same prompts every time)
    prompts: int = Field(default=256, ge=1)
    # an evaluation every this many steps (0: none during training), of the initial policy
    # (not on a resume) and after the last step
    every: int = Field(default=0, ge=0)
    at_start: bool = True
    at_end: bool = True
    # greedy pass@1, and pass@k estimated from `samples` completions a prompt sampled at the
    # run's temperature (k = 1: greedy alone)
    k: int = Field(default=1, ge=1)
    samples: int | None = Field(default=None, ge=1)
    # the reward that says a completion is correct (default: the recipe's first), and the score
    # that counts as correct
    reward: Identifier | None = None
    correct_at: float = 1.0

    @property
    def samples_drawn(self) -> int:
        return self.samples if self.samples is not None else self.k


class GeneratorLayout(_Strict):
    tp: int = Field(default=1, ge=1)
    replicas: int = Field(default=1, ge=1)


class ReferenceLayout(_Strict):
    enabled: bool = True
    # The frozen model is sharded over its GPUs (FSDP2, bf16), one process per GPU, like the
    # trainer's; each scores its share of a batch's rows.
    gpus: int = Field(default=1, ge=1)
    # gpu, or cpu: the reference scores in float32 on node 0's CPU cores, taking no GPU (slow:
    # for small models where a GPU is dearer than the time; the host needs the memory)
    device: Literal["gpu", "cpu"] = "gpu"
    # Where services share GPUs (layout.share all or trainer_reference), the planner also
    # weighs the reference sharded over every GPU the trainer has (its rows split over more
    # ranks: a shorter turn, a smaller shard on each GPU) and keeps the faster that fits.
    spread: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.enabled and self.device == "gpu"

    @property
    def on_cpu(self) -> bool:
        return self.enabled and self.device == "cpu"


class TrainerLayout(_Strict):
    # The trainer shards its weights, gradients and optimizer state over its GPUs (FSDP2).
    gpus: int = Field(default=1, ge=1)


class RewardLayout(_Strict):
    procs: int = Field(default=1, ge=1)


# Which GPU services share GPUs (and take turns on them): none (every service on GPUs of its
# own), trainer_reference (the generators on GPUs of their own, the trainer and the reference
# sharing the rest), all (every service on every GPU of one node), or auto: the planner
# predicts each that fits and takes the fastest (recipes/costs.py; `forgesky plan --explain`).
Share = Literal["auto", "none", "trainer_reference", "all"]


# How services placed on one GPU use it: turns (one GPU call at a time: a generate call, a
# scoring, a train step with its publish, a weight load; runtime/control/turns.py), or mps
# (their calls at once, as clients of an NVIDIA MPS daemon the run starts on its node:
# runtime/procs/mps.py; without MPS, processes on one GPU are time-sliced, which measured slower
# than turns). The predicted step counts turns; the memory check adds up every service's
# working memory on a GPU either way.
Sharing = Literal["turns", "mps"]


class MpsSmPercent(_Strict):
    """Under layout.sharing mps, the share of the GPU's SMs each service's kernels may use (in
    %: NVIDIA MPS's active thread percentage, set for that service's procs). 100 is all of them,
    as without a limit; less leaves the others room, e.g. the generator's decode beside the
    trainer's step."""

    generator: int = Field(default=100, ge=1, le=100)
    reference: int = Field(default=100, ge=1, le=100)
    trainer: int = Field(default=100, ge=1, le=100)

    def limited(self) -> tuple[tuple[str, int], ...]:
        """The services held below 100 %, with their share."""
        return tuple((name, pct) for name, pct in self.model_dump().items() if pct < 100)


class Layout(_Strict):
    generator: GeneratorLayout = GeneratorLayout()
    reference: ReferenceLayout = ReferenceLayout()
    trainer: TrainerLayout = TrainerLayout()
    reward: RewardLayout = RewardLayout()
    share: Share = "auto"
    sharing: Sharing = "turns"
    mps_sm_percent: MpsSmPercent = MpsSmPercent()


class Resources(_Strict):
    accelerator: Literal["H100", "H200", "cpu"] = "H100"
    alternatives: list[Literal["H100", "H200"]] = ["H200"]
    # each node's disk; auto: what the run writes (recipes/memory.py disk_plan)
    disk_gb: int | Literal["auto"] = "auto"

    _disk = field_validator("disk_gb")(lambda value: _at_least_one(value))
    gpus_per_node: int = Field(default=8, ge=1, le=64)


Auto = Literal["auto"]


def _at_least_one(value: int | str) -> int | str:
    if value != "auto" and value < 1:
        raise PydanticCustomError("positive", "must be >= 1 or auto, got {v}", {"v": value})
    return value


class GeneratorSettings(_Strict):
    """How each generator samples. "auto" values are planned (`forgesky plan` shows them)."""

    # vLLM on GPUs, transformers' generate on CPU
    backend: Literal["auto", "vllm", "hf"] = "auto"
    # vLLM's share of its GPU; with a fixed kv_cache_gb only the share that must be free to start
    gpu_memory_utilization: float | Auto = "auto"
    # a fixed KV cache (GB per GPU) instead of vLLM's profiling: planned when services share
    # the generator's GPU, whose free memory profiling would misread
    kv_cache_gb: float | Auto = "auto"
    # no torch.compile / CUDA graphs: a faster start, slower decoding
    enforce_eager: bool = False

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _share(cls, value: float | str) -> float | str:
        if value != "auto" and not 0 < value <= 1:
            raise PydanticCustomError("share", "must be in (0, 1] or auto, got {v}", {"v": value})
        return value

    @field_validator("kv_cache_gb")
    @classmethod
    def _positive(cls, value: float | str) -> float | str:
        if value != "auto" and value <= 0:
            raise PydanticCustomError("positive", "must be > 0 or auto, got {v}", {"v": value})
        return value


class TrainerSettings(_Strict):
    """How the trainer computes. "auto" values are planned for the GPU (`forgesky plan`)."""

    # trainer processes (FSDP ranks): one per trainer GPU; on a CPU recipe, gloo ranks
    ranks: int | Auto = "auto"
    # tokens per micro-batch (gradients accumulate): the largest that fits the GPU
    tokens_per_micro_batch: int | Auto = "auto"
    # recompute each block in backward (a third more FLOPs, much less memory): where needed
    activation_checkpointing: bool | Auto = "auto"
    # torch.compile each block and the output projection: on GPUs
    compile: bool | Auto = "auto"

    _positive = field_validator("ranks", "tokens_per_micro_batch")(_at_least_one)


class ReferenceSettings(_Strict):
    """How the reference scores (forward only)."""

    # reference processes (FSDP ranks): one per reference GPU; on a CPU recipe, gloo ranks
    ranks: int | Auto = "auto"
    tokens_per_micro_batch: int | Auto = "auto"
    compile: bool | Auto = "auto"

    _positive = field_validator("ranks", "tokens_per_micro_batch")(_at_least_one)


class WeightSyncSettings(_Strict):
    """How policy versions reach the generators (runtime/weights/transport.py)."""

    # auto: CUDA IPC on the trainer's GPU, NCCL push to other GPUs, TorchStore on CPU;
    # store: always TorchStore; push: also on CPU (over gloo)
    transport: Literal["auto", "store", "push"] = "auto"
    # where generators take the push path alone, how a version leaves trainer rank 0: version
    # (staged whole in one buffer beside its shards, sent while it trains on), groups (each
    # group's tensors sent as they are gathered, one group in flight: no copy of a version),
    # or auto: version where the trainer holds that buffer, else the store path
    push_buffer: Literal["auto", "version", "groups"] = "auto"
    # a weight-push collective whose peer died fails after this many seconds
    timeout_s: float = Field(default=300.0, gt=0)


class WatchdogSettings(_Strict):
    """How long the controller waits for a service's answer before it calls the service stuck
    (a wedged collective, a hung kernel) and ends the run (runtime/control/watchdog.py)."""

    # the first call of each kind (start-up, compiling, the first checkpoint or export)
    first_call_s: float = Field(default=1800.0, gt=0)
    # a later call: this many times the slowest answer of its kind so far, ...
    factor: float = Field(default=10.0, ge=1)
    # ... and never less than this
    min_s: float = Field(default=300.0, gt=0)


class Recipe(_Strict):
    """A complete, validated GRPO run description."""

    name: Identifier
    description: str
    model: Model
    dataset: Dataset
    grpo: Grpo
    layout: Layout = Layout()
    resources: Resources = Resources()
    eval: Eval = Eval()
    generator: GeneratorSettings = GeneratorSettings()
    trainer: TrainerSettings = TrainerSettings()
    reference: ReferenceSettings = ReferenceSettings()
    weight_sync: WeightSyncSettings = WeightSyncSettings()
    watchdog: WatchdogSettings = WatchdogSettings()

    @property
    def arch(self) -> Arch:
        """The architecture the model family and size name."""
        return architecture(self.model.family, self.model.size)

    @property
    def cpu(self) -> bool:
        return self.resources.accelerator == "cpu"

    @model_validator(mode="after")
    def _check_consistency(self) -> Recipe:
        errors = _consistency_errors(self)
        if errors:
            # The message names its own field path; the loader prints it as is.
            raise PydanticCustomError("recipe", errors[0])
        return self


def _eval_errors(r: Recipe) -> list[str]:
    e = r.eval
    if not e.enabled:
        return []
    errors = []
    if e.k > e.samples_drawn:
        errors.append(
            f"eval.k: pass@{e.k} needs at least {e.k} samples a prompt, but eval.samples is "
            f"{e.samples_drawn}"
        )
    path = e.path or r.dataset.path
    if path.startswith("builtin:"):
        if e.split not in BUILTIN_SPLITS:
            errors.append(
                f"eval.split: the shipped task {path} has no split {e.split!r} "
                f"(it has {', '.join(BUILTIN_SPLITS)})"
            )
    elif path == r.dataset.path and e.split == r.dataset.split:
        errors.append(
            f"eval.split: {e.split!r} is the split the run trains on (dataset.split); name a "
            "held-out one, or held-out data as eval.path"
        )
    else:
        errors += _local_split_errors(path, e.split, same_data=path == r.dataset.path)
    names = [w.name for w in r.dataset.rewards]
    if e.reward is not None and e.reward not in names:
        errors.append(
            f"eval.reward: {e.reward!r} is not one of the recipe's rewards ({', '.join(names)})"
        )
    return errors


def _local_split_errors(path: str, split: str, *, same_data: bool) -> list[str]:
    """What a look at local data (where it is on this machine) says about an eval split: a data
    file has no splits of its own, a saved dataset lists its splits. Hub data is checked when
    the run loads it."""
    local = Path(path).expanduser()
    if local.is_file() and same_data:
        return [
            f"eval: {path} is one data file, the one the run trains on; name a held-out file "
            "as eval.path"
        ]
    listing = local / "dataset_dict.json"
    if listing.is_file():
        try:
            splits = json.loads(listing.read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            return []
        if split not in splits:
            return [f"eval.split: {path} has no split {split!r} (it has {', '.join(splits)})"]
    return []


def _consistency_errors(r: Recipe) -> list[str]:
    fam, size = r.model.family, r.model.size
    if (fam, size) not in ARCHITECTURES:
        return [f"model.size: unknown {fam} size '{size}'; known sizes: {', '.join(sizes(fam))}"]
    arch = r.arch
    errors = []
    if r.model.thinking is not None and fam != "qwen3":
        errors.append(
            f"model.thinking: {fam} models have no thinking mode (Qwen3 has); leave it unset"
        )
    seq = r.grpo.max_prompt_tokens + r.grpo.max_response_tokens
    if seq > arch.max_seq_len:
        errors.append(
            f"grpo.max_prompt_tokens + grpo.max_response_tokens: {seq} exceeds the "
            f"{fam} {size} context of {arch.max_seq_len} tokens"
        )
    g = r.grpo
    mean = r.dataset.prompt_tokens_mean
    if mean is not None and mean > g.max_prompt_tokens:
        errors.append(
            f"dataset.prompt_tokens_mean: {mean} exceeds grpo.max_prompt_tokens "
            f"{g.max_prompt_tokens} (prompts are cut to it)"
        )
    errors += _eval_errors(r)
    if g.overlong_buffer > g.max_response_tokens:
        errors.append(
            f"grpo.overlong_buffer_tokens: {g.overlong_buffer} exceeds grpo.max_response_tokens "
            f"{g.max_response_tokens}"
        )
    if g.kl_placement == "reward" and not r.layout.reference.enabled and g.kl_beta:
        errors.append("grpo.kl_placement: reward needs a reference (layout.reference.enabled)")
    if g.steps_per_call > g.max_policy_age + 1:
        errors.append(
            f"grpo.steps_per_call: {g.steps_per_call} needs grpo.max_policy_age >= "
            f"{g.steps_per_call - 1} (the call's last step is trained on that many versions "
            f"later), got {g.max_policy_age}"
        )
    lay = r.layout
    tps = [("layout.generator.tp", lay.generator.tp)]
    ref = lay.reference
    if ref.enabled and (r.cpu or ref.device == "cpu") and ref.gpus != 1:
        errors.append(
            f"layout.reference.gpus: a reference on the CPU takes no GPU; set it to 1 "
            f"(reference.ranks sets its processes), got {ref.gpus}"
        )
    elif ref.enabled and ref.gpus > r.resources.gpus_per_node:
        errors.append(
            f"layout.reference.gpus: {ref.gpus} exceeds resources.gpus_per_node "
            f"{r.resources.gpus_per_node}; the reference's GPUs must sit on one node"
        )
    rranks = r.reference.ranks
    if ref.on_gpu and not r.cpu and rranks != "auto" and rranks != ref.gpus:
        errors.append(
            f"reference.ranks: {rranks} must be auto or layout.reference.gpus ({ref.gpus}): "
            "one reference process per GPU"
        )
    for path, tp in tps:
        if arch.n_heads % tp or arch.n_kv_heads % tp:
            errors.append(
                f"{path}: {tp} must divide the {fam} {size} head counts "
                f"(n_heads {arch.n_heads}, n_kv_heads {arch.n_kv_heads})"
            )
        elif r.cpu and tp != 1:
            errors.append(f"{path}: must be 1 on accelerator cpu, got {tp}")
        elif tp > r.resources.gpus_per_node:
            errors.append(
                f"{path}: {tp} exceeds resources.gpus_per_node {r.resources.gpus_per_node}; "
                "a tensor-parallel group must sit on one node"
            )
    limited = lay.mps_sm_percent.limited()
    if limited and lay.sharing != "mps":
        name = limited[0][0]
        errors.append(
            f"layout.mps_sm_percent.{name}: a share of the SMs applies under layout.sharing mps "
            "(services calling a GPU at once); with turns each call has the whole GPU"
        )
    t = lay.trainer
    if r.cpu and t.gpus != 1:
        errors.append(
            f"layout.trainer.gpus: must be 1 on accelerator cpu (trainer.ranks sets its "
            f"processes), got {t.gpus}"
        )
    ranks = r.trainer.ranks
    if not r.cpu and ranks != "auto" and ranks != t.gpus:
        errors.append(
            f"trainer.ranks: {ranks} must be auto or layout.trainer.gpus ({t.gpus}): one "
            "trainer process per GPU"
        )
    if errors:
        return errors
    return memory_errors(r, estimate_memory(r))
