"""What every backend promises, whatever runs it (HF/TorchTitan on CPU, vLLM/FSDP on GPU).

Actors are thin shells around these: they call the methods below and move the results.

Log-probs: every backend returns log-probs of the *temperature-scaled* distribution,
`log softmax(logits / temperature)[token]`, where `temperature` is the sampling temperature of the
run. top-p truncation is not part of it (a sampled token's log-prob is taken before the nucleus is
renormalised), so the trainer can recompute exactly the same quantity from logits alone; with
top_p = 1 it is the sampling distribution itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

FinishReason = Literal["stop", "length"]

# `loss_fn(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kwargs) -> (loss, stats)`,
# e.g. `runtime.grpo.policy_loss`.
LossFn = Callable[..., tuple[Tensor, dict[str, float]]]


@dataclass
class Completion:
    """One sampled response to one prompt.

    `response_logprobs[i]` is the log-prob of `response_ids[i]` (see the module docstring for which
    distribution). A response that ended on EOS includes the EOS id and finish_reason "stop".
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    policy_version: int
    finish_reason: FinishReason
    prompt_index: int = 0


@runtime_checkable
class GeneratorBackend(Protocol):
    """Samples completions with the current policy weights."""

    policy_version: int

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[Completion]:
        """`n` completions per prompt, prompt-major: result[i * n + j] is sample j of prompt i."""
        ...

    def load_weights(self, hf_state_dict: Mapping[str, Tensor]) -> None:
        """Copy HF-named weights into the running model in place."""
        ...


@runtime_checkable
class ScoringBackend(Protocol):
    """Teacher-forced log-probs of given tokens (the reference model is only this)."""

    def logprobs(self, tokens: Tensor, response_mask: Tensor) -> Tensor:
        """`lp[b, t] = log p(tokens[b, t] | tokens[b, :t])` at response positions, else 0."""
        ...


@runtime_checkable
class TrainerBackend(ScoringBackend, Protocol):
    """The policy being optimised."""

    step: int

    def train_step(
        self,
        tokens: Tensor,
        response_mask: Tensor,
        advantages: Tensor,
        old_logprobs: Tensor | None,
        ref_logprobs: Tensor | None,
        loss_fn: LossFn,
        **loss_kwargs: Any,
    ) -> dict[str, float]:
        """One optimizer step on the batch; returns loss stats plus grad_norm and lr."""
        ...

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The current weights under HF names (what gets published to generators)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs: model, optimizer, scheduler, step."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def token_logprobs(
    logits: Tensor, tokens: Tensor, response_mask: Tensor, temperature: float = 1.0
) -> Tensor:
    """Per-token log-probs in the `[B, T]` layout from next-token `logits[B, T, V]`.

    `logits[b, t]` predicts `tokens[b, t + 1]`; position 0 and non-response positions get 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    target = tokens[:, 1:].unsqueeze(-1)
    picked = scaled.gather(-1, target).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    out = torch.zeros(tokens.shape, dtype=picked.dtype, device=picked.device)
    out[:, 1:] = picked
    return out.masked_fill(~response_mask.bool(), 0.0)
