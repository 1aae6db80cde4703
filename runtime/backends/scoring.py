"""Teacher-forced log-probs of a TorchTitan decoder whose output projection runs only where a
response token is predicted, and the share of a batch's rows each rank scores or trains on."""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.backends.blocks import head_logprobs, head_outputs


def response_logprobs(
    model: torch.nn.Module,
    tokens: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    entropy: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """`lp[b, t] = log softmax(logits / T)[tokens[b, t]]` at response positions, else 0; with
    `entropy` (1: a metric, 2: with its graph) also the entropy of the distribution that
    predicted each response token, `(lp, entropy)`.

    Same values as `runtime.backends.base.token_logprobs`, but the output projection runs only
    on positions whose next token is a response token. `model` must have `_skip_lm_head` set.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    hidden = model(tokens)  # [B, T, D] after the final norm
    predicts = response_mask[:, 1:].bool()  # position t-1 predicts token t
    rows, target = hidden[:, :-1][predicts], tokens[:, 1:][predicts]
    if not entropy:
        head = getattr(model, "_head_logprobs", head_logprobs)
        return _scatter(head(model.lm_head, rows, target, temperature), predicts, tokens.shape)
    head = getattr(model, "_head_outputs", head_outputs)
    lp, ent = head(model.lm_head, rows, target, temperature, entropy)
    return _scatter(lp, predicts, tokens.shape), _scatter(ent, predicts, tokens.shape)


def _scatter(values: Tensor, predicts: Tensor, shape: torch.Size) -> Tensor:
    out = torch.zeros(shape, dtype=values.dtype, device=values.device)
    out[:, 1:] = out[:, 1:].masked_scatter(predicts, values)
    return out


def rank_rows(batch: int, rank: int, world: int) -> slice:
    """Rank `rank`'s contiguous share of `batch` rows (ranks differ by at most one row)."""
    base, extra = divmod(batch, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))
