"""The sections that say what a run trains: the model, its data and rewards, the GRPO
algorithm, and the evaluation on held-out prompts.

Each check here sees one section; checks across sections live in recipes/schema.py.
"""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from recipes.fields import Identifier, Strict
from recipes.names import (
    ALL_LINEAR,
    BUILTIN_REWARDS,
    BUILTIN_TASKS,
    FAMILIES,
    LORA_TARGETS,
    LOSS_AGGREGATION,
    LOSSES,
)

DEFAULT_PROMPT_TEMPLATE = "{question}\nThink step by step, then give the final answer after '####'."


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


class Lora(Strict):
    """A LoRA adapter on the frozen base: W x + (alpha / rank) B A x on each targeted projection."""

    rank: int
    # None means 2 x rank; kept as written so that a recorded config validates to the same recipe.
    alpha: float | None = None
    dropout: float = 0.0
    targets: list[str] | Literal["all-linear"] = ALL_LINEAR

    @field_validator("rank")
    @classmethod
    def _a_rank(cls, rank: int) -> int:
        if rank < 1:
            raise PydanticCustomError(
                "lora",
                "a LoRA rank is at least 1; remove model.lora to train every parameter",
            )
        return rank

    @field_validator("alpha")
    @classmethod
    def _a_scale(cls, alpha: float | None) -> float | None:
        if alpha is not None and alpha <= 0:
            raise PydanticCustomError(
                "lora",
                "must be > 0, got {v} (the adapter is scaled by alpha / rank); leave it out "
                "for 2 x rank",
                {"v": alpha},
            )
        return alpha

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, dropout: float) -> float:
        # TorchTitan's LoRA, the one the trainer runs, has no dropout: a value would be ignored
        if dropout != 0:
            raise PydanticCustomError(
                "lora",
                "{v} is not supported: TorchTitan's LoRA has no dropout; set 0 or leave it out",
                {"v": dropout},
            )
        return dropout

    @field_validator("targets", mode="before")
    @classmethod
    def _a_target_list(cls, targets: Any) -> Any:
        """The list's form; the names are checked against the family's (recipes/schema.py)."""
        if targets == ALL_LINEAR:
            return targets
        if not isinstance(targets, list):
            raise PydanticCustomError(
                "lora",
                "a list of projections (e.g. [q_proj, v_proj]) or {all}, got {v}",
                {"all": ALL_LINEAR, "v": repr(targets)},
            )
        if not targets:
            raise PydanticCustomError(
                "lora",
                "an empty list wraps nothing; name projections, or {all} for all of them",
                {"all": ALL_LINEAR},
            )
        if ALL_LINEAR in targets:
            raise PydanticCustomError(
                "lora",
                "{all} stands alone (targets: {all}), not in a list",
                {"all": ALL_LINEAR},
            )
        names = [name for name in targets if isinstance(name, str)]  # others: the type check
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise PydanticCustomError("lora", "{v} is listed twice", {"v": repr(twice)})
        return targets

    @property
    def scaling_alpha(self) -> float:
        """alpha as used: the recipe's, or 2 x rank."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

    @property
    def scaling(self) -> float:
        """The factor on B A x: alpha / rank."""
        return self.scaling_alpha / self.rank

    @property
    def modules(self) -> tuple[str, ...]:
        """The targeted projections' Hugging Face names, in LORA_TARGETS' order."""
        chosen = set(LORA_TARGETS) if self.targets == ALL_LINEAR else set(self.targets)
        return tuple(name for name in LORA_TARGETS if name in chosen)


class Model(Strict):
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
    # Train a LoRA adapter on the frozen base instead of every parameter (absent: every one).
    lora: Lora | None = None

    _builtin = field_validator("hf_id", "tokenizer")(_shipped)


class Reward(Strict):
    name: Identifier
    weight: float = 1.0

    @field_validator("name")
    @classmethod
    def _known_form(cls, name: str) -> str:
        return known_reward(name)


def known_reward(name: str) -> str:
    """`name` if it names a reward (a shipped one, builtin:<task> or module:function)."""
    if name in BUILTIN_REWARDS or (":" in name and all(name.split(":", 1))):
        return _shipped(name)
    raise PydanticCustomError(
        "reward_name",
        "unknown reward '{name}'; use math, gsm8k_format, format, builtin:<name> or "
        "module:function",
        {"name": name},
    )


class Dataset(Strict):
    path: Identifier
    config: Identifier | None = None
    split: Identifier = "train"
    prompt_field: Identifier = "question"
    answer_field: Identifier = "answer"
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    system_prompt: str | None = None
    # at least one, except in a recipe with an `env` section (there the environment scores)
    rewards: list[Reward] = Field(default_factory=list)
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


class Grpo(Strict):
    group_size: int = Field(ge=2)
    prompts_per_step: int = Field(ge=1)
    max_prompt_tokens: int = Field(gt=0)
    max_response_tokens: int = Field(gt=0)
    learning_rate: float = Field(gt=0)
    kl_beta: float = Field(ge=0)
    # the loss holds each ratio to the sampling policy within [1 - clip_low, 1 + clip_high]
    # (runtime/grpo/losses.py); a ratio is never below 0, so clip_low is at most 1 (1: no clip
    # below)
    clip_low: float
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

    @field_validator("clip_low")
    @classmethod
    def _a_ratio_bound(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise PydanticCustomError(
                "clip",
                "must be in [0, 1], got {v} (a ratio is clipped from below at 1 - clip_low, "
                "and a ratio is never below 0)",
                {"v": value},
            )
        return value

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


class Eval(Strict):
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
