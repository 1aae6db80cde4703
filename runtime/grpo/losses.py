"""Policy losses: GRPO, Dr.GRPO, DAPO, GSPO, CISPO and SAPO, and your own.

Every loss has one signature: `fn(inputs: LossInputs, config: LossConfig) -> (loss, stats)`,
where `loss` is the per-token policy-gradient loss `[B, T]` (aggregated by `config.aggregation`)
or an already aggregated scalar, and `stats` are floats for the metrics. `policy_loss` adds the
KL penalty and the entropy bonus with the same aggregation and returns the micro-batch's share of
the whole batch's loss. A recipe names a built-in (`grpo.loss: dapo`) or its own function
(`grpo.loss: mypkg.losses:my_loss`), imported on the trainer procs.

Conventions (as the docstrings below say per loss):
- ratio `r = exp(lp - old)` per token (old: the log-probs of the policy that sampled);
- aggregation, over the whole batch (every micro-batch and rank normalises by the batch's
  counts, so their losses and gradients add up to the batch's):
  "sequence_mean": each sequence's token mean, summed over sequences / B (GRPO, GSPO, SAPO);
  "token_mean": sum over every loss token of the batch / their number (DAPO, CISPO);
  "constant": sum / (B * max_response_tokens) (Dr.GRPO);
  B counts every sequence of the batch, those with no loss token too (they add 0);
- a sequence with no response token adds 0 to every loss.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from recipes.names import AGGREGATIONS


@dataclass
class LossInputs:
    """What a loss sees for one micro-batch (`[B, T]` tensors, prompt then response).

    - `logprobs`: the policy being trained, per token (carries the graph); 0 off the response;
    - `old_logprobs`: the policy that sampled the tokens (the generator's);
    - `ref_logprobs`: the frozen reference's, or None (no reference);
    - `advantages`: one per sequence `[B]`;
    - `mask`: True at the response tokens that carry loss (a filtered sequence has none);
    - `entropy`: the policy's entropy at each position `[B, T]` (with a graph only when the
      recipe's entropy bonus is on), or None;
    - `num_sequences`, `num_tokens`: the whole batch's sequences and loss tokens;
    - `max_response_tokens`: the recipe's.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    mask: Tensor
    entropy: Tensor | None = None
    num_sequences: int | None = None
    num_tokens: int | None = None
    max_response_tokens: int | None = None

    @property
    def log_ratio(self) -> Tensor:
        """`lp - old` at loss tokens, 0 elsewhere (padding may hold anything: never exp'd)."""
        zero = torch.zeros((), dtype=self.logprobs.dtype, device=self.logprobs.device)
        return torch.where(self.mask, self.logprobs - self.old_logprobs, zero)


@dataclass(frozen=True)
class LossConfig:
    """The recipe's loss settings (recipes.run_sections.Grpo), resolved."""

    name: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_beta: float = 0.0  # the KL term's weight in the loss (0 when the KL goes to the reward)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # the entropy bonus: loss -= coef * entropy
    aggregation: str = "sequence_mean"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_grpo(cls, grpo: Any) -> LossConfig:
        """From a recipe's `grpo` section."""
        return cls(
            name=grpo.loss,
            clip_low=grpo.clip_low,
            clip_high=grpo.clip_high,
            kl_beta=grpo.kl_beta if grpo.kl_placement == "loss" else 0.0,
            kl_estimator=grpo.kl_estimator,
            entropy_coef=grpo.entropy_coef,
            aggregation=grpo.aggregation_mode,
            sapo_tau_pos=grpo.sapo_tau_pos,
            sapo_tau_neg=grpo.sapo_tau_neg,
        )


LossFn = Callable[[LossInputs, LossConfig], tuple[Tensor, dict[str, float]]]


# --- the built-in losses ------------------------------------------------------------------------


def _clip_stats(ratio: Tensor, adv: Tensor, low: float, high: float, mask: Tensor) -> dict:
    n = mask.float().sum().clamp(min=1.0)
    clipped_low = (mask & (adv < 0) & (ratio < low)).float().sum() / n
    clipped_high = (mask & (adv > 0) & (ratio > high)).float().sum() / n
    return {
        "clip_fraction/low": clipped_low,
        "clip_fraction/high": clipped_high,
        "ratio/mean": (ratio.detach() * mask).sum() / n,
    }


def clipped_surrogate(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    """PPO's clipped surrogate per token, `-min(r A, clip(r, 1 - low, 1 + high) A)`: the
    policy part of GRPO, Dr.GRPO and DAPO (they differ in aggregation and sampling)."""
    ratio = torch.exp(inputs.log_ratio)
    a = inputs.advantages.detach().float()[:, None]
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    per_token = -torch.minimum(ratio * a, ratio.clamp(low, high) * a)
    return per_token, _clip_stats(ratio, a, low, high, inputs.mask)


def gspo(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    """GSPO (arXiv 2507.18071): one ratio per sequence, `s = exp(mean_t(lp - old))`, clipped
    like PPO's. Written per token as `sg(s) * exp(lp - sg(lp))` (each token's gradient is `s`
    times its own score), which with "sequence_mean" aggregation is the sequence objective."""
    mask = inputs.mask
    lengths = mask.float().sum(dim=1).clamp(min=1.0)
    seq_log = (inputs.log_ratio.sum(dim=1) / lengths).detach()
    lp = torch.where(mask, inputs.logprobs.float(), torch.zeros((), device=mask.device))
    ratio = torch.exp((lp - lp.detach() + seq_log[:, None]).clamp(max=10.0))
    a = inputs.advantages.detach().float()[:, None]
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    per_token = -torch.minimum(ratio * a, ratio.clamp(low, high) * a)
    stats = _clip_stats(ratio, a, low, high, mask)
    has = (mask.sum(dim=1) > 0).float()
    n = has.sum().clamp(min=1.0)
    seq_ratio = torch.exp(seq_log)
    stats["clip_fraction/low"] = ((a[:, 0] < 0) & (seq_ratio < low)).float().mul(has).sum() / n
    stats["clip_fraction/high"] = ((a[:, 0] > 0) & (seq_ratio > high)).float().mul(has).sum() / n
    stats["ratio/mean"] = (seq_ratio * has).sum() / n
    return per_token, stats


def cispo(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    """CISPO (arXiv 2506.13585): REINFORCE on every token weighted by the clipped ratio with its
    gradient stopped, `-sg(clip(r, 1 - low, 1 + high)) A lp`: no token's gradient is cut off."""
    ratio = torch.exp(inputs.log_ratio)
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    weight = ratio.clamp(low, high).detach()
    a = inputs.advantages.detach().float()[:, None]
    lp = torch.where(inputs.mask, inputs.logprobs.float(), torch.zeros((), device=a.device))
    per_token = -weight * a * lp
    stats = _clip_stats(ratio, a, low, high, inputs.mask)
    n = inputs.mask.float().sum().clamp(min=1.0)
    # every clipped weight, whatever the advantage's sign (CISPO clips weights, not updates)
    stats["clip_fraction/low"] = (inputs.mask & (ratio < low)).float().sum() / n
    stats["clip_fraction/high"] = (inputs.mask & (ratio > high)).float().sum() / n
    return per_token, stats


def sapo(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    """SAPO (arXiv 2511.20347): a soft gate in place of the hard clip,
    `-f(r) A` with `f(r) = sigmoid(tau (r - 1)) * 4 / tau` (tau_pos where A > 0, tau_neg
    elsewhere): near r = 1 it is the plain ratio's gradient, and it fades smoothly away from 1."""
    ratio = torch.exp(inputs.log_ratio)
    a = inputs.advantages.detach().float()[:, None]
    tau = torch.where(
        a > 0,
        torch.tensor(config.sapo_tau_pos, device=a.device),
        torch.tensor(config.sapo_tau_neg, device=a.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token = -gate * a
    n = inputs.mask.float().sum().clamp(min=1.0)
    stats = {"ratio/mean": (ratio.detach() * inputs.mask).sum() / n}
    return per_token, stats


# The policy-gradient part of each built-in (recipes.names.LOSS_AGGREGATION: their aggregations).
BUILTIN: dict[str, LossFn] = {
    "grpo": clipped_surrogate,
    "dr_grpo": clipped_surrogate,
    "dapo": clipped_surrogate,
    "gspo": gspo,
    "cispo": cispo,
    "sapo": sapo,
}


# --- your own -----------------------------------------------------------------------------------


def resolve_loss(name: str) -> LossFn:
    """The policy-gradient function a recipe's `grpo.loss` names: a built-in or
    `module:function` (imported now). Raises ValueError with one line when it cannot be used."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"grpo.loss {name!r}: use one of {', '.join(BUILTIN)} or module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name or module_name.startswith(f"{e.name}."):
            raise ValueError(f"grpo.loss {name!r}: module {module_name!r} not found") from None
        raise ValueError(f"grpo.loss {name!r}: importing {module_name!r} failed: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"grpo.loss {name!r}: {module_name} has no function {attr!r}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ValueError(
            f"grpo.loss {name!r}: {attr} must take (inputs, config) (runtime.grpo.LossInputs, "
            f"runtime.grpo.LossConfig), it takes ({', '.join(p.name for p in params)})"
        )
    return fn


# --- the whole objective ------------------------------------------------------------------------


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_sequences: float,
    num_tokens: float,
    max_response_tokens: int | None,
) -> Tensor:
    """A `[B, T]` per-token quantity as this micro-batch's share of the batch's scalar."""
    # padding may hold anything (0, -inf, nan): select, never multiply by the mask
    masked = torch.where(
        mask, per_token, torch.zeros((), dtype=per_token.dtype, device=mask.device)
    )
    if mode == "sequence_mean":
        lengths = mask.float().sum(dim=1).clamp(min=1.0)
        return (masked.sum(dim=1) / lengths).sum() / num_sequences
    if mode == "token_mean":
        return masked.sum() / max(num_tokens, 1.0)
    if mode == "constant":
        if not max_response_tokens:
            raise ValueError("the constant aggregation needs max_response_tokens")
        return masked.sum() / (num_sequences * max_response_tokens)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")
