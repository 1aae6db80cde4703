"""Writes the tiny-sft recipe's data (recipes/catalog/data/tiny-sft-*.jsonl): chats in which the
user gives a string of digits and the assistant counts on from its last digit, as many digits as
the user gave (mod 10: "358" -> "901"), in the tiny model's vocabulary (digits only). Deterministic: the same seed writes the same files.

    python scripts/tiny_sft_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "recipes" / "catalog" / "data"
ROWS = {"train": 512, "test": 64}


def count_on(digits: str) -> str:
    last = int(digits[-1])
    return "".join(str((last + i) % 10) for i in range(1, len(digits) + 1))


def rows(n: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 8)))
        out.append(
            {
                "messages": [
                    {"role": "user", "content": digits},
                    {"role": "assistant", "content": count_on(digits)},
                ]
            }
        )
    return out


def main() -> None:
    rng = random.Random(0)
    OUT.mkdir(parents=True, exist_ok=True)
    for split, n in ROWS.items():
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows(n, rng))
        (OUT / f"tiny-sft-{split}.jsonl").write_text(text)


if __name__ == "__main__":
    main()
