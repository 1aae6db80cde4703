"""The SFT recipe: supervised fine-tuning on chat data, with the GRPO recipe's model, resources
and trainer sections, and a trainer as its only service.

A recipe file with an `sft` section is an SFT recipe (one with `grpo` a GRPO recipe,
recipes/schema.py); the loader picks the class by that section. Its sections:

- `model`: as GRPO's (recipes/run_sections.py::Model), `model.lora` included.
- `dataset`: what it trains on: a Hugging Face dataset or local data (JSONL, say) of chat
  `messages` or `prompt`/`completion` pairs, the fields named; the most tokens a row may take
  after the family's chat template (`max_tokens`), and what happens to a longer one (`overlong`:
  truncate or drop; the run counts them).
- `sft`: the optimisation: learning rate and schedule, the tokens an optimiser step trains on
  (rows packed into micro-batches of `trainer.tokens_per_micro_batch` tokens), steps,
  checkpoints.
- `eval`: the held-out loss, on a split of the same data or a file of its own.
- `layout.trainer.gpus`: the trainer's GPUs, the least the recipe runs on (no generator, no
  reference); a plan on more GPUs of one node gives the trainer all of them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from recipes.architectures import ARCHITECTURES, ModelRecipe, sizes
from recipes.fields import Identifier, Strict
from recipes.files import same_local
from recipes.run_sections import Model, _shipped, known_reward
from recipes.service_sections import (
    Resources,
    TrainerLayout,
    TrainerSettings,
    WatchdogSettings,
)

# The forms a row of SFT data takes: a chat (a list of {role, content}) or a prompt and its
# completion (two strings: one user turn and the assistant's answer).
SFT_FORMATS = ("messages", "prompt_completion")


class SftDataset(Strict):
    path: Identifier
    config: Identifier | None = None
    split: Identifier = "train"
    format: Literal["messages", "prompt_completion"] = "messages"
    messages_field: Identifier = "messages"
    prompt_field: Identifier = "prompt"
    completion_field: Identifier = "completion"
    # a system turn put before every conversation that has none
    system_prompt: str | None = None
    # the most tokens a row takes after the chat template; a longer row is cut to it (truncate)
    # or left out (drop), and the run counts both
    max_tokens: int = Field(gt=0)
    overlong: Literal["truncate", "drop"] = "drop"

    @model_validator(mode="after")
    def _shipped_path(self) -> SftDataset:
        _shipped(self.path)
        return self

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields a row must have, as the recipe names them."""
        if self.format == "messages":
            return (self.messages_field,)
        return (self.prompt_field, self.completion_field)


class Sft(Strict):
    learning_rate: float = Field(gt=0)
    # tokens of packed rows an optimiser step trains on (over every rank): micro-batches of
    # trainer.tokens_per_micro_batch tokens, as many as make it up
    tokens_per_step: int = Field(gt=0)
    steps: int = Field(ge=1)
    checkpoint_interval: int = Field(ge=0)
    checkpoint_finish_s: float = Field(default=120.0, ge=0)
    seed: int = 0
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    # after warmup: hold the learning rate, or decay it linearly to 0 at the last step
    lr_schedule: Literal["constant", "linear"] = "constant"
    # how a packed row's samples are kept apart: varlen (TorchTitan's variable-length flash
    # attention over the samples), document (SDPA under a dense same-sample mask: L x L
    # booleans a row), flex (TorchTitan's flex attention block mask); auto: varlen on GPUs,
    # document on the CPU (varlen and flex train on GPUs only)
    attention: Literal["auto", "varlen", "document", "flex"] = "auto"
    # how a step's rows fill its micro-batches: best_fit (longest first, each into the fullest
    # micro-batch it fits: fewer, fuller micro-batches) or in_order (as the data reads)
    packing: Literal["best_fit", "in_order"] = "best_fit"


class SftEval(Strict):
    """The held-out loss: the mean loss per assistant token over held-out rows; and where
    `reward` names a reward, `forgesky eval`'s pass@k on them."""

    enabled: bool = True
    # a split of the dataset section's data, or other data as `path` (same fields)
    split: Identifier = "test"
    path: Identifier | None = None
    # the first this many rows of it, in its order (the same rows every time)
    rows: int = Field(default=256, ge=1)
    # a held-out loss every this many steps (0: only at the start and the end)
    every: int = Field(default=0, ge=0)
    # pass@k (`forgesky eval`), where `reward` names one as a GRPO recipe's dataset.rewards do
    # (math, gsm8k_format, format, builtin:<task>, module:function): each of the first
    # `prompts` held-out rows is its turns before its last assistant turn, whose content is
    # the answer the reward is given; greedy pass@1, and pass@k from `samples` (default k)
    # completions of up to `max_new_tokens` sampled at `temperature`; a completion is correct
    # where the reward gives it at least `correct_at`
    reward: Identifier | None = None
    prompts: int = Field(default=64, ge=1)
    k: int = Field(default=1, ge=1)
    samples: int | None = Field(default=None, ge=1)
    max_new_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    correct_at: float = 1.0

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, name: str | None) -> str | None:
        return None if name is None else known_reward(name)

    @property
    def samples_drawn(self) -> int:
        return self.samples if self.samples is not None else self.k


class SftLayout(Strict):
    trainer: TrainerLayout = TrainerLayout()


class SftRecipe(ModelRecipe, Strict):
    """A complete, validated SFT run description."""

    name: Identifier
    description: str
    model: Model
    dataset: SftDataset
    sft: Sft
    eval: SftEval = SftEval()
    layout: SftLayout = SftLayout()
    resources: Resources = Resources()
    trainer: TrainerSettings = TrainerSettings()
    watchdog: WatchdogSettings = WatchdogSettings()

    @property
    def seed(self) -> int:
        """The seed of the run's random init and data order."""
        return self.sft.seed

    @property
    def kind(self) -> str:
        """What the recipe trains by: "sft" (a GRPO recipe's is "grpo")."""
        return "sft"

    @model_validator(mode="after")
    def _check_consistency(self) -> SftRecipe:
        errors = _consistency_errors(self)
        if errors:
            raise PydanticCustomError("recipe", errors[0])
        return self


def _consistency_errors(r: SftRecipe) -> list[str]:
    from recipes.schema import local_split_errors, lora_shape_errors, unread_model_errors

    fam, size = r.model.family, r.model.size
    if (fam, size) not in ARCHITECTURES:
        return [f"model.size: unknown {fam} size '{size}'; known sizes: {', '.join(sizes(fam))}"]
    arch = r.arch
    errors = unread_model_errors(r.model)
    if r.model.thinking is not None and fam != "qwen3":
        errors.append(
            f"model.thinking: {fam} models have no thinking mode (Qwen3 has); leave it unset"
        )
    if r.model.lora is not None:
        errors += lora_shape_errors(r.model.lora, arch, fam, size)
    d = r.dataset
    if d.max_tokens > arch.max_seq_len:
        errors.append(
            f"dataset.max_tokens: {d.max_tokens} exceeds the {fam} {size} context of "
            f"{arch.max_seq_len} tokens"
        )
    micro = r.trainer.tokens_per_micro_batch
    if micro != "auto" and micro < d.max_tokens:
        errors.append(
            f"trainer.tokens_per_micro_batch: {micro} is less than dataset.max_tokens "
            f"{d.max_tokens}; a row is packed whole into one micro-batch"
        )
    if r.sft.tokens_per_step < d.max_tokens:
        errors.append(
            f"sft.tokens_per_step: {r.sft.tokens_per_step} is less than dataset.max_tokens "
            f"{d.max_tokens}; a step trains on at least one whole row"
        )
    if r.sft.warmup_steps > r.sft.steps:
        errors.append(f"sft.warmup_steps: {r.sft.warmup_steps} exceeds sft.steps {r.sft.steps}")
    e = r.eval
    if e.enabled:
        path = e.path or d.path
        same = path == d.path or same_local(path, d.path)
        if same and e.split == d.split:
            errors.append(
                f"eval.split: {e.split!r} is the split the run trains on (dataset.split); name "
                "a held-out one, or held-out data as eval.path"
            )
        else:
            errors += local_split_errors(path, e.split, same_data=same)
    if e.reward is None and (e.k > 1 or e.samples is not None):
        errors.append("eval.k: pass@k is scored by a reward; name one as eval.reward")
    if e.samples_drawn < e.k:
        errors.append(f"eval.samples: {e.samples} is fewer than eval.k {e.k}")
    t = r.layout.trainer
    if r.cpu and r.sft.attention in ("varlen", "flex"):
        errors.append(
            f"sft.attention: {r.sft.attention} trains on GPUs only; on accelerator cpu use auto "
            "or document"
        )
    if r.cpu and t.gpus != 1:
        errors.append(
            f"layout.trainer.gpus: must be 1 on accelerator cpu (trainer.ranks sets its "
            f"processes), got {t.gpus}"
        )
    if not r.cpu and t.gpus > r.resources.gpus_per_node:
        errors.append(
            f"layout.trainer.gpus: {t.gpus} exceeds resources.gpus_per_node "
            f"{r.resources.gpus_per_node}; the trainer's GPUs sit on one node"
        )
    ranks = r.trainer.ranks
    if not r.cpu and ranks != "auto" and ranks != t.gpus:
        errors.append(
            f"trainer.ranks: {ranks} must be auto or layout.trainer.gpus ({t.gpus}): one "
            "trainer process per GPU"
        )
    if errors:
        return errors
    return memory_errors(r)


def trainer_memory(r: SftRecipe, gpus: int, accelerator: str) -> tuple[int, bool, float] | None:
    """The trainer's micro-batch tokens, activation checkpointing and peak bytes a GPU on `gpus`
    GPUs of `accelerator` (recipes.memory.trainer_memory_plan), or None where nothing fits."""
    from recipes.memory import ACCELERATOR_BYTES, trainer_memory_plan

    t = r.trainer
    return trainer_memory_plan(
        r.arch,
        gpus,
        ACCELERATOR_BYTES[accelerator],
        tokens=None if t.tokens_per_micro_batch == "auto" else t.tokens_per_micro_batch,
        checkpointing=None if t.activation_checkpointing == "auto" else t.activation_checkpointing,
        compiled=t.compile is not False,
        lora=r.model.lora,
    )


def packed_attention(recipe: Any, gpu: bool) -> str:
    """How an SFT trainer keeps a packed row's samples apart (recipe sft.attention): auto is
    varlen on GPUs (on one H200 a Qwen3-1.7B step of 26,248 packed tokens took 0.61 s against
    the dense mask's 1.13 s: bench/results/gpu_h200x2_2026-11-29-sft/sft_step_varlen2.log) and
    the dense document mask on the CPU, where varlen and flex do not train."""
    chosen = recipe.sft.attention
    if chosen == "auto":
        return "varlen" if gpu else "document"
    return chosen


_TRAINER_KEYS = (
    "ranks",
    "tokens_per_micro_batch",
    "activation_checkpointing",
    "compile",
    "gather_once",
)


def planned_trainer(
    r: SftRecipe, gpus: int, accelerator: str, fit: tuple[int, bool, float] | None = None
) -> tuple[Any, tuple[str, ...]]:
    """The trainer's settings on `gpus` GPUs of `accelerator` (recipes.settings.TrainerSettings:
    a rank a GPU, the memory plan's micro-batch and checkpointing, compiled unless the recipe
    says not, gather_once where it fits) and the settings that were auto ("trainer.ranks", ...).
    `fit`: `trainer_memory`'s answer where the caller has it already.
    """
    from recipes.errors import UserError
    from recipes.memory import GB
    from recipes.settings import TrainerSettings

    fit = fit or trainer_memory(r, gpus, accelerator)
    if fit is None:  # the plan checked it; a --set since may not fit
        raise UserError(f"{r.name}: the trainer does not fit {gpus} x {accelerator}")
    tokens, checkpointing, _ = fit
    gather, peak = gather_plan(r, gpus, accelerator, fit)
    t = r.trainer
    trainer = TrainerSettings(
        ranks=gpus,
        tokens_per_micro_batch=tokens,
        activation_checkpointing=checkpointing,
        compile=True if t.compile == "auto" else t.compile,
        gather_once=gather,
        peak_gb=round(peak / GB, 1),
    )
    return trainer, tuple(f"trainer.{k}" for k in _TRAINER_KEYS if getattr(t, k) == "auto")


def settings_data(r: SftRecipe, trainer: Any, planned: tuple[str, ...]) -> dict[str, Any]:
    """An SFT run's settings on GPUs (`plan --json`'s `sft_settings`, and the plan's lines,
    recipes.plan_words.sft_lines): the trainer's as the run takes them (`planned_trainer`), the
    sft section's attention and packing, and which of them the plan chose (`planned`)."""
    values = {k: getattr(trainer, k) for k in _TRAINER_KEYS}
    attention_planned = r.sft.attention == "auto"
    return {
        "trainer": {**values, "peak_gb": trainer.peak_gb},
        "attention": packed_attention(r, gpu=True),
        "packing": r.sft.packing,
        "planned": [*planned, *(["sft.attention"] if attention_planned else [])],
    }


def gather_plan(
    r: SftRecipe, gpus: int, accelerator: str, fit: tuple[int, bool, float]
) -> tuple[bool, float]:
    """trainer.gather_once (`gather_once`) and a rank's planned step bytes for the trainer on
    `gpus` GPUs of `accelerator` at `fit` (`trainer_memory`: micro-batch, checkpointing and the
    step's bytes without it)."""
    from recipes.memory import planned_peak

    tokens, ckpt, peak = fit
    gather = gather_once(r, gpus, accelerator, tokens, ckpt)
    compiled = r.trainer.compile is not False
    return gather, planned_peak(peak, gather, r.arch, gpus, tokens, ckpt, compiled, r.model.lora)


def gather_once(r: SftRecipe, gpus: int, accelerator: str, tokens: int, ckpt: bool) -> bool:
    """trainer.gather_once for the trainer on `gpus` GPUs of `accelerator` at the planned
    micro-batch and checkpointing: the recipe's value, or where auto, whether several ranks'
    step still fits with the whole model gathered (recipes.memory.gather_once_fits)."""
    from recipes.memory import ACCELERATOR_BYTES, gather_once_fits

    given = r.trainer.gather_once
    if given != "auto":
        return bool(given) and gpus > 1
    return gather_once_fits(
        r.arch,
        gpus,
        ACCELERATOR_BYTES[accelerator],
        tokens,
        ckpt,
        r.trainer.compile is not False,
        r.model.lora,
    )


def memory_errors(r: SftRecipe) -> list[str]:
    """The trainer on layout.trainer.gpus GPUs against the accelerator (a CPU recipe is not
    checked)."""
    if r.cpu:
        return []
    gpus, acc = r.layout.trainer.gpus, r.resources.accelerator
    if trainer_memory(r, gpus, acc) is not None:
        return []
    return [
        f"layout.trainer.gpus: the {r.model.family} {r.model.size} trainer does not fit "
        f"{gpus} x {acc} with any micro-batch (trainer.tokens_per_micro_batch, "
        "trainer.activation_checkpointing); give it more GPUs"
    ]


def sft_plan(r: SftRecipe, gpus: int, gpn: int, nodes: int | None, accelerator: str) -> Any:
    """The Plan of an SFT run: the trainer alone, on node 0, on all `gpus` GPUs (at least
    layout.trainer.gpus, at most one node's); on CPU one trainer placement and no GPU. The
    generic checks (counts, disk) are the planner's (recipes/planner.py)."""
    from recipes.errors import UserError
    from recipes.memory import RUNTIME_OVERHEAD_GB, disk_plan, host_plan
    from recipes.placements import Placement
    from recipes.plan_words import Plan, lora_words

    need = r.layout.trainer.gpus
    common = dict(
        recipe_name=r.name,
        generator_replicas=0,
        generator_tp=1,
        reference_enabled=False,
        reference_gpus=0,
        reward_procs=0,
        lora=lora_words(r) if r.model.lora is not None else "",
    )
    if r.cpu:
        return Plan(
            **common,
            total_gpus=0,
            gpus_per_node=0,
            num_nodes=nodes or 1,
            cpu=True,
            trainer_gpus=0,
            placements=(Placement("trainer", 0, 0, ()),),
            memory={},
            accelerator="cpu",
        )
    if gpus < need:
        fewer = gpus > 0 and trainer_memory(r, gpus, accelerator) is not None
        raise UserError(
            f"{r.name} needs at least {need} x {accelerator} (the trainer's GPUs, "
            f"layout.trainer.gpus), got --gpus {gpus}"
            + (f"; its trainer fits {gpus} (--set layout.trainer.gpus={gpus})" if fewer else "")
        )
    if gpus > gpn:
        raise UserError(
            f"--gpus {gpus}: an SFT trainer runs on one node, at most {gpn} GPUs "
            "(resources.gpus_per_node)"
        )
    if nodes is not None and nodes != 1:
        raise UserError(f"{r.name} runs on one node, not {nodes}")
    if r.trainer.ranks != "auto" and r.trainer.ranks != gpus:
        raise UserError(
            f"trainer.ranks {r.trainer.ranks}: an SFT trainer takes a rank on each GPU it is "
            f"given (--gpus {gpus}); leave trainer.ranks auto, or give --gpus {r.trainer.ranks}"
        )
    fit = trainer_memory(r, gpus, accelerator)
    if fit is None:
        raise UserError(
            f"{r.name}: the trainer does not fit {gpus} x {accelerator} with any micro-batch; "
            "give it more GPUs"
        )
    from recipes.costs import predict_sft_step

    trainer, planned = planned_trainer(r, gpus, accelerator, fit)
    step = predict_sft_step(r, accelerator, gpus, checkpointing=trainer.activation_checkpointing)
    return Plan(
        **common,
        total_gpus=gpus,
        gpus_per_node=gpus,
        num_nodes=1,
        cpu=False,
        trainer_gpus=gpus,
        placements=(Placement("trainer", 0, 0, tuple(range(gpus))),),
        memory={"trainer": round(trainer.peak_gb + RUNTIME_OVERHEAD_GB, 1)},
        accelerator=accelerator,
        minimum_gpus=need,
        dedicated_gpus=need,
        disk=disk_plan(r),
        host=host_plan(r, gpus),
        predicted_step_s=step.seconds,
        ranked_at=f"{r.sft.tokens_per_step:,} tokens a step (sft.tokens_per_step)",
        prediction=f"trainer; speeds from {step.basis}",
        sft_settings=settings_data(r, trainer, planned),
    )
