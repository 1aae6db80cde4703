"""Teacher-forced log-probs of a TorchTitan decoder whose output projection runs only where a
response token is predicted, the share of a batch's rows each rank scores or trains on, and the
no-grad scoring loop the GPU reference and a LoRA trainer's reference share."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.backends.blocks import head_logprobs, head_outputs, micro_batches


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


def score_rows(
    model: torch.nn.Module,
    tokens: Tensor,
    response_mask: Tensor,
    *,
    temperature: float,
    tokens_per_micro_batch: int,
    device: torch.device,
    world: int = 1,
    precision: contextlib.AbstractContextManager | None = None,
) -> Tensor:
    """`response_logprobs` of the rows given, under `no_grad` (and `precision`, an autocast),
    in micro-batches of about `tokens_per_micro_batch` tokens. With several FSDP ranks (each
    scoring its own rows, `rank_rows`) every rank must call it: each forward gathers every block
    from all ranks, so all run as many forwards, and the root is resharded after."""
    parts = micro_batches(tokens, tokens_per_micro_batch) if len(tokens) else []
    extra = passes_missing(len(parts), world, device)
    out = []
    with torch.no_grad(), precision or contextlib.nullcontext():
        for p in parts:
            out.append(
                response_logprobs(
                    model, tokens[p].to(device), response_mask[p].to(device), temperature
                )
            )
        for _ in range(extra):  # only for its collectives (`stand_in`)
            response_logprobs(model, *stand_in(tokens, response_mask, parts, device), temperature)
    if world > 1:
        # FSDP2 keeps the root's weights (embeddings, output projection) gathered after a
        # forward, for a backward that never comes here: shard them again now, or every rank
        # holds all of them from the first scoring on.
        model.reshard()
    if not out:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=device)
    return torch.cat(out)


def passes_missing(count: int, world: int, device: torch.device | str) -> int:
    """How many forward (and backward) passes this rank, with `count` micro-batches, must add
    to run as many as the rank with the most (a collective: every rank calls it). FSDP2 gathers
    every block from all ranks in each pass: a rank that ran fewer would leave the others
    waiting for it for good. 0 on one rank."""
    if world <= 1:
        return 0
    most = torch.tensor([count], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item()) - count


def stand_in(
    tokens: Tensor, response_mask: Tensor, parts: list[slice], device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """The tokens and response mask of an added pass (`passes_missing`): a copy of this rank's
    first micro-batch, of shapes the compiled blocks were made for (a pass of one row would
    compile them again: torch.compile specializes a size of 1), or two tokens where the rank has
    no row at all. Its result counts zero times."""
    if parts:
        first = parts[0]
        return tokens[first].to(device), response_mask[first].to(device)
    one = torch.zeros(1, 2, dtype=torch.long, device=device)
    return one, torch.ones_like(one, dtype=torch.bool)


def response_lists(logprobs: Tensor, response_mask: Tensor) -> list[list[float]]:
    """Each row's log-probs of its response tokens, in order (what a reference answers)."""
    mask = response_mask.bool()
    return [row[keep].tolist() for row, keep in zip(logprobs.float().cpu(), mask, strict=True)]
