"""GRPO math: group-relative advantages, the policy losses, the KL estimators, and the one
function the trainers call, `policy_loss`. Pure torch, no process or model code: every formula
is testable on tiny tensors.

Token layout follows the runtime convention: `[B, T]` tensors (prompt then response,
right-padded) with a boolean mask that is True at response tokens; advantages are one value per
sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recipes.names import LOSS_AGGREGATION, LOSSES
from runtime.grpo.advantages import group_advantages, informative
from runtime.grpo.kl import ESTIMATORS, kl_per_token
from runtime.grpo.losses import (
    AGGREGATIONS,
    LossConfig,
    LossFn,
    LossInputs,
    aggregate,
    resolve_loss,
)

VARIANTS: tuple[str, ...] = LOSSES

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "VARIANTS",
    "LossConfig",
    "LossFn",
    "LossInputs",
    "group_advantages",
    "informative",
    "kl_per_token",
    "policy_loss",
    "resolve_loss",
]

# Summed over micro-batches and ranks (each is its share of the batch's value); every other
# stat is a mean weighted by response_tokens.
SUMMED_STATS = ("loss", "pg_loss", "response_tokens")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    variant: str = "grpo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_beta: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    aggregation: str | None = None,
    config: LossConfig | None = None,
    max_response_tokens: int | None = None,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    entropy: Tensor | None = None,
    loss_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's loss and its stats: the policy-gradient loss of `variant` (a built-in,
    see runtime/grpo/losses.py, or `module:function`), plus `kl_beta` times the KL to the
    reference, minus `entropy_coef` times the entropy, each aggregated alike.

    - `logprobs` `[B, T]`: the policy being trained (carries the graph);
    - `old_logprobs` `[B, T]`: the policy that sampled the tokens; None means on-policy
      (`logprobs.detach()`);
    - `ref_logprobs` `[B, T]` or None: with it `stats["kl"]` is reported (the KL enters the loss
      only when `kl_beta != 0`);
    - `advantages` `[B]`, `mask` `[B, T]` (True at response tokens); `loss_mask` (default
      `mask`) leaves out tokens that carry no loss (a filtered sequence);
    - `config` replaces `variant`, the clips, the KL and the entropy arguments (what the trainer
      passes: the recipe's, resolved); `aggregation` defaults to the loss's own;
    - `num_sequences` / `num_tokens`: the whole batch's sequences and loss tokens (default:
      this micro-batch's), so micro-batch losses add up to the batch's.
    """
    if config is None:
        config = LossConfig(
            name=variant,
            clip_low=clip_low,
            clip_high=clip_high,
            kl_beta=kl_beta,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            aggregation=aggregation or LOSS_AGGREGATION.get(variant, "sequence_mean"),
        )
    elif aggregation is not None:
        raise ValueError("pass the aggregation in the config")
    fn = resolve_loss(config.name)
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} must be [B, T]"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] = [{logprobs.shape[0]}]"
        )
    mask = mask.bool()
    loss_mask = mask if loss_mask is None else loss_mask.bool() & mask
    lp = logprobs.float()
    old = lp.detach() if old_logprobs is None else old_logprobs.detach().float()
    inputs = LossInputs(
        logprobs=lp,
        old_logprobs=old,
        ref_logprobs=None if ref_logprobs is None else ref_logprobs.detach().float(),
        advantages=advantages,
        mask=loss_mask,
        entropy=entropy,
        num_sequences=int(num_sequences or lp.shape[0]),
        num_tokens=int(num_tokens if num_tokens is not None else loss_mask.sum()),
        max_response_tokens=max_response_tokens,
    )

    def total(per_token: Tensor) -> Tensor:
        return aggregate(
            per_token,
            loss_mask,
            config.aggregation,
            num_sequences=float(inputs.num_sequences),
            num_tokens=float(inputs.num_tokens),
            max_response_tokens=max_response_tokens,
        )

    pg, pg_stats = fn(inputs, config)
    pg_loss = total(pg) if pg.dim() == 2 else pg
    loss = pg_loss
    n = loss_mask.float().sum().clamp(min=1.0)
    values: dict[str, Tensor] = {}
    if inputs.ref_logprobs is not None:
        # measured whenever there is a reference (a run's health signal); trained only with beta
        kl = kl_per_token(lp, inputs.ref_logprobs, loss_mask, config.kl_estimator)
        if config.kl_beta != 0.0:
            loss = loss + config.kl_beta * total(kl)
        values["kl"] = kl.detach().sum() / n
    else:
        values["kl"] = torch.zeros((), device=lp.device)
    if entropy is not None:
        if config.entropy_coef != 0.0:
            loss = loss - config.entropy_coef * total(entropy.float())
        values["entropy"] = (entropy.detach().float() * loss_mask).sum() / n
    values["loss"] = loss.detach()
    values["pg_loss"] = pg_loss.detach()
    values["response_tokens"] = loss_mask.float().sum()
    for key, value in pg_stats.items():
        values[key] = value if isinstance(value, Tensor) else torch.tensor(float(value))
    if "clip_fraction/low" in values and "clip_fraction/high" in values:
        values["clip_fraction"] = values["clip_fraction/low"] + values["clip_fraction/high"]
    keys = list(values)
    # One device-to-host copy for all stats instead of one sync per number.
    numbers = torch.stack([values[k].detach().float().to(lp.device) for k in keys]).tolist()
    return loss, dict(zip(keys, numbers, strict=True))
