"""Rollout groups into the `[B, T]` layout the reference and the trainer score, in one pass:
tokens, response mask, the generator's log-probs and (once scored) the reference's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from runtime.control.buffer import Group
from runtime.grpo import group_advantages


@dataclass
class RolloutBatch:
    """Right-padded sequences (prompt then response) of some groups, completion-major in group
    order, and what lines up with them; log-probs are 0 off the response. In an episode the
    response is every turn and the mask holds only the tokens the model sampled."""

    tokens: Tensor  # Long[B, T]
    response_mask: Tensor  # Bool[B, T]
    old_logprobs: Tensor  # Float[B, T]: the generator's
    ref_logprobs: Tensor | None  # Float[B, T]: the reference's, if scored


def spread(values: Sequence[float], mask: Sequence[bool]) -> list[float]:
    """Values of the masked positions (in order) laid out over the whole mask, 0 elsewhere."""
    it = iter(values)
    out = [next(it) if m else 0.0 for m in mask]
    if next(it, None) is not None:
        raise ValueError(f"{len(values)} values for {sum(mask)} masked positions")
    return out


def collate_groups(groups: Sequence[Group], pad_id: int) -> RolloutBatch:
    """Every completion of `groups` in one batch, in order."""
    rows = [(gr, i) for gr in groups for i in range(len(gr.responses))]
    if not rows:
        raise ValueError("collate needs at least one completion")
    with_ref = all(gr.ref_logprobs for gr in groups)
    lengths = [len(gr.prompt_tokens) + len(gr.responses[i]) for gr, i in rows]
    shape = (len(rows), max(lengths))
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.bool)
    old = torch.zeros(shape, dtype=torch.float32)
    ref = torch.zeros(shape, dtype=torch.float32) if with_ref else None
    for row, (gr, i) in enumerate(rows):
        response, logprobs = gr.responses[i], gr.response_logprobs[i]
        if len(logprobs) != len(response):
            raise ValueError(
                f"completion {row}: {len(response)} response tokens but {len(logprobs)} log-probs"
            )
        start, end = len(gr.prompt_tokens), lengths[row]
        tokens[row, :start] = torch.tensor(gr.prompt_tokens, dtype=torch.long)
        tokens[row, start:end] = torch.tensor(response, dtype=torch.long)
        if gr.response_masks:  # an episode: only the tokens the model sampled
            if len(gr.response_masks[i]) != len(response):
                raise ValueError(
                    f"completion {row}: {len(response)} response tokens but a mask of "
                    f"{len(gr.response_masks[i])}"
                )
            mask[row, start:end] = torch.tensor(gr.response_masks[i], dtype=torch.bool)
        else:
            mask[row, start:end] = True
        old[row, start:end] = torch.tensor(logprobs, dtype=torch.float32)
        if ref is not None:
            ref[row, start:end] = torch.tensor(gr.ref_logprobs[i], dtype=torch.float32)
    return RolloutBatch(tokens, mask, old, ref)


def train_batch(
    groups: Sequence[Group],
    *,
    pad_id: int,
    group_size: int,
    loss: str,
    version: int,
    advantage_std: str = "population",
    mask_truncated: bool = False,
) -> tuple[dict[str, Any], dict[str, float]]:
    """What one optimizer step trains on (tokens, response mask, advantages, the generator's
    and the reference's log-probs; with `mask_truncated`, a loss mask without the completions
    cut at the length limit), and the step's reward and length metrics."""
    batch = collate_groups(groups, pad_id)
    rewards = torch.tensor([r for gr in groups for r in gr.rewards], dtype=torch.float32)
    advantages = group_advantages(
        rewards.view(len(groups), group_size),
        scale_by_std=loss != "dr_grpo",
        std=advantage_std,
    ).flatten()
    truncated = torch.tensor(
        [t for gr in groups for t in (gr.truncated or [False] * len(gr.responses))]
    )
    info = {
        "response/truncated_share": float(truncated.float().mean()),
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "response/len_mean": float(batch.response_mask.sum(dim=1).float().mean()),
        "prompt/len_mean": sum(len(gr.prompt_tokens) for gr in groups) / len(groups),
        "policy/staleness_mean": float(
            sum(version - gr.policy_version for gr in groups) / len(groups)
        ),
    }
    for name in groups[0].reward_parts:
        vals = [v for gr in groups for v in gr.reward_parts[name]]
        info[f"reward/{name}"] = sum(vals) / len(vals)
    train = {
        "tokens": batch.tokens,
        "response_mask": batch.response_mask,
        "advantages": advantages,
        "old_logprobs": batch.old_logprobs,
        "ref_logprobs": batch.ref_logprobs,
    }
    if mask_truncated:
        train["loss_mask"] = batch.response_mask & ~truncated[:, None]
    return train, info
