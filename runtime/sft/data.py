"""SFT data: rows of chat `messages` or `prompt`/`completion` pairs as token ids through the
tokenizer's chat template, each token marked trained or not (the assistant's turns are), and
packed into micro-batches of a token budget with positions that restart at each row.

The assistant's span of the rendered text: from the end of the conversation before it, rendered
with the generation prompt (so the prompt the model will be given is not trained), to the end
of its turn (its closing marker trained: the model learns to stop). Tokens are marked by their
character offsets in the rendered text.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from recipes.errors import UserError
from recipes.sft_rows import conversation, no_template


@dataclass(frozen=True)
class Example:
    """One row: its token ids and, per token, whether it is the assistant's (trained)."""

    ids: list[int]
    trained: list[bool]


@dataclass
class Counts:
    """What became of the rows read: used whole, cut to dataset.max_tokens, left out."""

    rows: int = 0
    truncated: int = 0
    dropped: int = 0


class ChatEncoder:
    """A tokenizer's chat template applied to conversations, with the assistant's tokens marked."""

    def __init__(self, tokenizer: Any, *, thinking: bool | None = None, where: str = "tokenizer"):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(no_template(where))
        self.tokenizer = tokenizer
        self.extra = {} if thinking is None else {"enable_thinking": thinking}

    def render(self, messages: Sequence[Mapping[str, str]], prompt: bool = False) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=prompt, **self.extra
        )

    def spans(self, messages: Sequence[Mapping[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = _prefix_length(full, self.render(messages[:i], prompt=True))
            if start is None:  # a template whose generation prompt the full text differs from
                start = _prefix_length(full, self.render(messages[:i]))
            if start is None:
                raise UserError(
                    "the chat template renders the turns before an assistant turn differently "
                    "from the whole conversation; its tokens cannot be told apart"
                )
            alone = self.render(messages[: i + 1])
            end = _prefix_length(full, alone)
            if end is None:  # rendered otherwise once turns follow (Qwen3: no empty think block)
                content = message["content"]
                closing = alone[alone.rfind(content) + len(content) :]
                at = full.find(content, start)
                if at < 0 or not full.startswith(closing, at + len(content)):
                    raise UserError("the chat template renders an assistant turn out of order")
                end = at + len(content) + len(closing)
            spans.append((start, end))
        return full, spans

    def encode(self, messages: Sequence[Mapping[str, str]]) -> Example:
        """The conversation's token ids, the assistant's tokens (by where they start) trained."""
        text, spans = self.spans(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        trained = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
        return Example(list(enc["input_ids"]), trained)


def _prefix_length(full: str, part: str) -> int | None:
    return len(part) if full.startswith(part) else None


def examples(
    rows: Sequence[Mapping[str, Any]],
    order: Sequence[int],
    encoder: ChatEncoder,
    dataset: Any,
    counts: Counts,
) -> Iterator[Example]:
    """The rows in `order`, encoded; one longer than dataset.max_tokens cut to it or left out
    (dataset.overlong), `counts` kept."""
    limit = dataset.max_tokens
    for i in order:
        ex = encoder.encode(conversation(rows[i], dataset))
        counts.rows += 1
        if len(ex.ids) > limit:
            if dataset.overlong == "drop":
                counts.dropped += 1
                continue
            counts.truncated += 1
            ex = Example(ex.ids[:limit], ex.trained[:limit])
        if any(ex.trained[1:]):
            yield ex
        else:  # cut before the assistant spoke: nothing left to train on
            counts.dropped += 1


@dataclass
class Packed:
    """One micro-batch: rows end to end in one sequence of `tokens` [1, L], `positions` that
    restart at 0 at each row, and `targets` [1, L]: the next token where it is trained, else -100
    (never across two rows)."""

    tokens: Tensor
    positions: Tensor
    targets: Tensor
    rows: int = 0
    lengths: list[int] = field(default_factory=list)
    # a rank's stand-in where it has no micro-batch of its own (runtime.sft.train.filler): run
    # like the micro-batch it copies, its loss counted zero times
    filler: bool = False

    @property
    def trained_tokens(self) -> int:
        return 0 if self.filler else int((self.targets != -100).sum())


IGNORE = -100


def pack(batch: Sequence[Example], length: int | None = None, pad_id: int = 0) -> Packed:
    """`batch` end to end, padded to `length` (if given) by a filler row that is not trained."""
    ids, pos, targets, lengths = [], [], [], []
    for ex in batch:
        ids += ex.ids
        pos += range(len(ex.ids))
        nxt = [t if keep else IGNORE for t, keep in zip(ex.ids[1:], ex.trained[1:], strict=True)]
        targets += [*nxt, IGNORE]
        lengths.append(len(ex.ids))
    if length is not None and len(ids) < length:
        fill = length - len(ids)
        ids += [pad_id] * fill
        pos += filler_positions(fill, max(lengths, default=fill)).tolist()
        targets += [IGNORE] * fill
    as_row = lambda v: torch.tensor(v, dtype=torch.long)[None]  # noqa: E731
    return Packed(as_row(ids), as_row(pos), as_row(targets), len(batch), lengths)


def filler_positions(fill: int, longest: int) -> Tensor:
    """Positions of `fill` padding tokens: rows of their own no longer than `longest` (a real
    row's length), so that no position passes the model's context."""
    return torch.arange(fill) % max(longest, 1)


def padded(p: Packed, length: int, pad_id: int = 0) -> Packed:
    """`p` with filler rows (trained nowhere, positions from 0, none longer than its longest
    row) making it `length` tokens long; `p` itself where it is that long already."""
    fill = length - p.tokens.shape[1]
    if fill <= 0:
        return p
    from dataclasses import replace

    tail = lambda value: torch.full((1, fill), value, dtype=torch.long)  # noqa: E731
    return replace(
        p,
        tokens=torch.cat([p.tokens, tail(pad_id)], 1),
        positions=torch.cat(
            [p.positions, filler_positions(fill, max(p.lengths, default=fill))[None]], 1
        ),
        targets=torch.cat([p.targets, tail(IGNORE)], 1),
    )


def best_fit(rows: Sequence[Example], budget: int) -> list[list[Example]]:
    """`rows` in micro-batches of at most `budget` tokens by best-fit decreasing: the longest row
    first, each into the fullest micro-batch it still fits, else a new one (rows of one length
    keep the order given, so the same rows in the same order give the same micro-batches).
    Fewer, fuller micro-batches than packing in order when lengths vary (a step of 262,144
    tokens in rows of 256-2,048 at 8,192 a micro-batch: 32-33 instead of 35-36); a row longer
    than `budget` gets one of its own."""
    bins: list[list[Example]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -len(r.ids)):  # a stable sort
        n = len(row.ids)
        best = min(
            (b for b in range(len(bins)) if room[b] >= n), key=room.__getitem__, default=None
        )
        if best is None:
            bins.append([row])
            room.append(budget - n)
        else:
            bins[best].append(row)
            room[best] -= n
    return bins


def micro_batches(
    stream: Iterator[Example],
    budget: int,
    *,
    pad_to: bool = True,
    pad_id: int = 0,
    packing: str = "in_order",
) -> Iterator[Packed]:
    """Examples packed into micro-batches of at most `budget` tokens: in order (a row that does
    not fit the current one starts the next), or `packing="best_fit"` (`best_fit`: the stream's
    rows all read first)."""
    if packing == "best_fit":
        for part in best_fit(list(stream), budget):
            yield pack(part, budget if pad_to else None, pad_id)
        return
    current: list[Example] = []
    used = 0
    for ex in stream:
        if current and used + len(ex.ids) > budget:
            yield pack(current, budget if pad_to else None, pad_id)
            current, used = [], 0
        current.append(ex)
        used += len(ex.ids)
    if current:
        yield pack(current, budget if pad_to else None, pad_id)


def token_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Summed cross-entropy of the trained targets (fp32), and nothing of the others."""
    return torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
