"""GRPO math: group-relative advantages and the clipped policy losses (GRPO, Dr.GRPO, GSPO).

Pure torch, no process or model code, so every formula here is testable on tiny tensors.
Token layout follows the runtime convention: `[B, T]` tensors (prompt then response, right-padded)
with a boolean `mask` that is True at response tokens; advantages are one value per sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recipes.names import LOSSES

LossVariant = str  # one of recipes.names.LOSSES
VARIANTS: tuple[str, ...] = LOSSES


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages: `(r - mean) / (std + eps)` per group, or `r - mean` (Dr.GRPO).

    `rewards` is `[num_groups, group_size]`, or flat `[num_groups * group_size]` with `group_size`
    given (completions of one prompt contiguous); the result has the shape of the input.

    The std is the population std (divide by `group_size`, not `group_size - 1`): the advantages of
    a group then have mean 0 and root-mean-square 1 whatever the group size, so the loss scale does
    not depend on `group_size`. A group whose rewards are all equal gets advantages of 0.
    """
    if rewards.dim() == 1:
        if group_size is None:
            raise ValueError("flat rewards need group_size")
        if rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
        grouped = rewards.reshape(-1, group_size)
    elif rewards.dim() == 2:
        if group_size is not None and rewards.shape[1] != group_size:
            raise ValueError(f"rewards {tuple(rewards.shape)} do not match group_size {group_size}")
        grouped = rewards
    else:
        raise ValueError(f"rewards must be 1-D or 2-D, got shape {tuple(rewards.shape)}")

    grouped = grouped.float()
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, correction=0, keepdim=True) + eps)
    return centered.reshape(rewards.shape)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    variant: LossVariant = "grpo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_beta: float = 0.0,
    max_response_tokens: int | None = None,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with an optional k3 KL penalty; returns `(loss, stats)`.

    - `logprobs` `[B, T]`: the policy being trained (carries the graph).
    - `old_logprobs` `[B, T]`: the log-probs of the policy that sampled the tokens (the generator's);
      None means on-policy (`logprobs.detach()`).
    - `ref_logprobs` `[B, T]` or None: the frozen reference. With it, `stats["kl"]` is reported;
      the KL enters the loss (times `kl_beta`) only when `kl_beta != 0`.
    - `advantages` `[B]`, `mask` `[B, T]` (True at response tokens).

    The ratio is `exp(logprobs - old_logprobs)` per token (GSPO: `exp` of the per-sequence mean of
    that log-ratio), clipped to `[1 - clip_low, 1 + clip_high]` and combined PPO-style as
    `min(ratio * A, clip(ratio) * A)`. Per-token KL is `exp(ref - lp) - (ref - lp) - 1`.

    Aggregation: "grpo" averages the tokens of each sequence, then the sequences; "dr_grpo" sums all
    tokens and divides by `B * max_response_tokens` (a constant, so long answers are not
    down-weighted); "gspo" is one term per sequence (its KL is the sequence's mean token KL),
    averaged over sequences. A sequence with no response token adds 0 but still counts in `B`.

    `num_sequences` replaces `B` in every "average over sequences" (default `B`): pass the whole
    batch's size when it is split into micro-batches, so the micro-batch losses (and gradients)
    sum to the loss of the whole batch.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown loss variant {variant!r}; expected one of {VARIANTS}")
    if variant == "dr_grpo" and not max_response_tokens:
        raise ValueError("dr_grpo needs max_response_tokens (its constant normaliser)")
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} must be [B, T]"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] = [{logprobs.shape[0]}]"
        )

    mask = mask.bool()
    maskf = mask.float()
    lp = logprobs.float()
    old = lp.detach() if old_logprobs is None else old_logprobs.detach().float()
    adv = advantages.detach().float()
    lengths = maskf.sum(dim=1)
    safe_lengths = lengths.clamp(min=1.0)
    num_tokens = maskf.sum().clamp(min=1.0)

    # Padded positions can hold anything (0, -inf from a masked softmax): select before exp so a
    # pad never turns into inf * 0 = nan, in the value or the gradient.
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    log_ratio = torch.where(mask, lp - old, zero)

    low, high = 1.0 - clip_low, 1.0 + clip_high
    if variant == "gspo":
        seq_ratio = torch.exp(log_ratio.sum(dim=1) / safe_lengths)
        surrogate = torch.minimum(seq_ratio * adv, seq_ratio.clamp(low, high) * adv)
        pg_per_seq = -surrogate
        clipped_low = (adv < 0) & (seq_ratio < low)
        clipped_high = (adv > 0) & (seq_ratio > high)
        has_tokens = lengths > 0
        n_units = has_tokens.float().sum().clamp(min=1.0)
        clip_low_frac = (clipped_low & has_tokens).float().sum() / n_units
        clip_high_frac = (clipped_high & has_tokens).float().sum() / n_units
        ratio_mean = (seq_ratio.detach() * has_tokens).sum() / n_units
    else:
        ratio = torch.exp(log_ratio)
        a = adv[:, None]
        surrogate = torch.minimum(ratio * a, ratio.clamp(low, high) * a)
        pg_per_token = -surrogate * maskf
        clipped_low = mask & (a < 0) & (ratio < low)
        clipped_high = mask & (a > 0) & (ratio > high)
        clip_low_frac = clipped_low.float().sum() / num_tokens
        clip_high_frac = clipped_high.float().sum() / num_tokens
        ratio_mean = (ratio.detach() * maskf).sum() / num_tokens

    # KL is measured whenever a reference is given (it is a run's health signal) but only enters
    # the loss when kl_beta != 0.
    has_ref = ref_logprobs is not None
    if has_ref:
        ref_diff = torch.where(mask, ref_logprobs.detach().float() - lp, zero)
        kl_per_token = (torch.exp(ref_diff) - ref_diff - 1.0) * maskf
    else:
        kl_per_token = torch.zeros_like(lp)
    beta = kl_beta if has_ref else 0.0

    n_seqs = float(num_sequences or lp.shape[0])
    if variant == "gspo":
        pg_loss = pg_per_seq.sum() / n_seqs
        kl_term = (kl_per_token.sum(dim=1) / safe_lengths).sum() / n_seqs
    elif variant == "grpo":
        pg_loss = (pg_per_token.sum(dim=1) / safe_lengths).sum() / n_seqs
        kl_term = (kl_per_token.sum(dim=1) / safe_lengths).sum() / n_seqs
    else:
        denom = n_seqs * max_response_tokens
        pg_loss = pg_per_token.sum() / denom
        kl_term = kl_per_token.sum() / denom
    loss = pg_loss + beta * kl_term if beta != 0.0 else pg_loss

    # One device-to-host copy for all stats instead of one sync per number.
    values = torch.stack(
        [
            loss.detach(),
            pg_loss.detach(),
            kl_per_token.detach().sum() / num_tokens,
            clip_low_frac + clip_high_frac,
            clip_low_frac,
            clip_high_frac,
            ratio_mean,
            lengths.sum(),
        ]
    ).tolist()
    keys = (
        "loss",
        "pg_loss",
        "kl",
        "clip_fraction",
        "clip_fraction/low",
        "clip_fraction/high",
        "ratio/mean",
        "response_tokens",
    )
    stats = dict(zip(keys, values, strict=True))
    return loss, stats
