"""What every backend promises, whatever runs it (HF/TorchTitan on CPU, vLLM/FSDP on GPU).

Actors are thin shells around these: they call the methods below and move the results.

Log-probs: every backend returns log-probs of the *temperature-scaled* distribution,
`log softmax(logits / temperature)[token]`, where `temperature` is the sampling temperature of the
run. top-p truncation is not part of it (a sampled token's log-prob is taken before the nucleus is
renormalised), so the trainer can recompute exactly the same quantity from logits alone; with
top_p = 1 it is the sampling distribution itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

FinishReason = Literal["stop", "length"]

# `loss_fn(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, entropy, loss_mask,
# num_sequences, num_tokens, **kwargs) -> (loss, stats)`: `runtime.grpo.policy_loss`.
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
        logprobs: bool = True,
    ) -> list[Completion]:
        """`n` completions per prompt, prompt-major: result[i * n + j] is sample j of prompt i.
        Without `logprobs` (an evaluation) `temperature` may be 0 (greedy) and the log-probs
        are 0."""
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


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """The entropy of `softmax(logits / temperature)` over the last dimension, in fp32."""
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    return torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)


class NonFiniteGradients(RuntimeError):
    """A step's gradient norm came out NaN or infinite; the optimizer step was not taken."""


def finite_grad_norm(grad_norm: Tensor | float, step: int) -> float:
    """The gradient norm of optimizer step `step` (1-based) as a float, or `NonFiniteGradients`
    before the step is taken: an update by NaN or infinite gradients would make every weight
    NaN, which the generators would then load and sample from."""
    value = float(grad_norm)
    if math.isfinite(value):
        return value
    from runtime.procs.mps import client_sm_percent  # the failure path only

    share = client_sm_percent()
    # NaN norms in step 1 came from the trainer under MPS at 70 % of an H200's SMs on two hosts
    # (bench/results/gpu_h200x2_2026-11-27h and 27i), the same run's losses finite
    mps = (
        f"; this trainer runs under MPS at {share} % of the GPU's SMs "
        "(layout.mps_sm_percent.trainer), where runs have given NaN norms with finite losses: "
        "try 100 or layout.sharing=turns"
        if share is not None
        else ""
    )
    raise NonFiniteGradients(
        f"training step {step}: the gradient norm is {value}; the optimizer step was not "
        f"taken (the weights stay step {step - 1}'s): a NaN or infinite value in the backward "
        "(the loss, the advantages, or the GPU); resume from the last committed checkpoint, "
        f"perhaps with a lower grpo.lr{mps}"
    )


def loss_inputs(
    loss_kwargs: dict[str, Any], response_mask: Tensor
) -> tuple[dict[str, Any], Tensor | None, int]:
    """What a trainer needs to hand a batch's micro-batches to `runtime.grpo.policy_loss`:
    the loss keywords with the whole batch's counts (`num_sequences`, `num_tokens`), the loss
    mask (`loss_mask` taken out of them, to be sliced per micro-batch), and how to compute the
    entropy (1: a metric without graph; 2: with its graph, for an entropy bonus)."""
    kwargs = dict(loss_kwargs)
    loss_mask = kwargs.pop("loss_mask", None)
    config = kwargs.get("config")
    coef = config.entropy_coef if config is not None else kwargs.get("entropy_coef", 0.0)
    counted = response_mask if loss_mask is None else loss_mask & response_mask.bool()
    kwargs.update(num_sequences=response_mask.shape[0], num_tokens=int(counted.sum()))
    return kwargs, loss_mask, 2 if coef else 1
