"""Completions → the `[B, T]` token layout the trainer and reference score."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.backends.base import Completion


@dataclass
class TokenBatch:
    """Right-padded sequences (prompt then response) and what lines up with them.

    `logprobs[b, t]` is the generator's log-prob of `tokens[b, t]` (0 off the response), so it can
    be passed as `old_logprobs` directly.
    """

    tokens: Tensor  # Long[B, T]
    response_mask: Tensor  # Bool[B, T]
    logprobs: Tensor  # Float[B, T]
    policy_versions: Tensor  # Long[B]

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(dim=1)

    def to(self, device: str | torch.device) -> TokenBatch:
        return TokenBatch(
            self.tokens.to(device),
            self.response_mask.to(device),
            self.logprobs.to(device),
            self.policy_versions.to(device),
        )


def collate(
    completions: Sequence[Completion], pad_id: int, pad_to_multiple_of: int = 1
) -> TokenBatch:
    """Stack completions into one right-padded batch, in the order given."""
    if not completions:
        raise ValueError("collate needs at least one completion")
    lengths = [len(c.prompt_ids) + len(c.response_ids) for c in completions]
    width = max(lengths)
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(completions)
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.bool)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    for row, c in enumerate(completions):
        if len(c.response_logprobs) != len(c.response_ids):
            raise ValueError(
                f"completion {row}: {len(c.response_ids)} response tokens but "
                f"{len(c.response_logprobs)} log-probs"
            )
        start, end = len(c.prompt_ids), lengths[row]
        tokens[row, :start] = torch.tensor(c.prompt_ids, dtype=torch.long)
        tokens[row, start:end] = torch.tensor(c.response_ids, dtype=torch.long)
        mask[row, start:end] = True
        logprobs[row, start:end] = torch.tensor(c.response_logprobs, dtype=torch.float32)
    versions = torch.tensor([c.policy_version for c in completions], dtype=torch.long)
    return TokenBatch(tokens, mask, logprobs, versions)
