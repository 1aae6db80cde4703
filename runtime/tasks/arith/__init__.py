"""`arith`: GSM8K-shaped arithmetic word problems and a character tokenizer, made locally.

For runs that cannot reach the Hugging Face Hub (random-weight speed and memory runs of the
real architectures): `dataset.path: builtin:arith` gives prompts with GSM8K's columns
(`question`, `answer` ending in `#### N`), so the GSM8K recipes' templates and math/format
rewards apply unchanged; `model.tokenizer: builtin:arith` gives a tokenizer with one token per
printable ASCII character, padded to the model's vocabulary size so every id the model can
sample decodes. A prompt is about 120-160 characters, i.e. as many tokens (+1 for <bos>).

    python -m runtime --recipe qwen3-1.7b --set model.init=random \
        --set model.tokenizer=builtin:arith --set dataset.path=builtin:arith

`SHIPPED` is what `builtin:arith` stands for (runtime/tasks/registry.py); the package stays
light (no torch).
"""

from __future__ import annotations

import random
from typing import Any

from runtime.tasks.shipped import ShippedTask

NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells")
PROBLEMS = 2000


def problem(rng: random.Random) -> dict[str, str]:
    """One two-step word problem and its GSM8K-style worked answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, boxes, per_box = rng.randint(10, 90), rng.randint(2, 9), rng.randint(3, 15)
    given = rng.randint(1, start)
    total = start + boxes * per_box - given
    question = (
        f"{name} has {start} {item}. {name} buys {boxes} boxes with {per_box} {item} in each "
        f"box and then gives {given} {item} to a friend. How many {item} does {name} have now?"
    )
    answer = (
        f"{name} buys {boxes} * {per_box} = {boxes * per_box} {item}. "
        f"{start} + {boxes * per_box} - {given} = {total}.\n#### {total}"
    )
    return {"question": question, "answer": answer}


def rows(split: str = "train", count: int = PROBLEMS, seed: int = 0) -> list[dict[str, str]]:
    """`count` problems, the same for a given seed; "test" draws from another seed and skips
    every problem that "train" has, so it is held out."""
    if split == "train":
        rng = random.Random(f"arith:{seed}")
        return [problem(rng) for _ in range(count)]
    seen = {row["question"] for row in rows("train", count, seed)}
    rng, out = random.Random(f"arith-test:{seed}"), []
    while len(out) < count:
        row = problem(rng)
        if row["question"] not in seen:
            out.append(row)
    return out


def tokenizer(vocab_size: int | None = None) -> Any:
    """Character tokenizer: <pad>=0, <bos>=1, <eos>=2, printable ASCII and newline, then
    filler tokens up to `vocab_size` (they decode to nothing)."""
    from runtime.tasks.arith.tokenization import build_tokenizer

    return build_tokenizer(vocab_size)


SHIPPED = ShippedTask("arith", rows=rows, tokenizer=tokenizer)

__all__ = ["SHIPPED", "problem", "rows", "tokenizer"]
