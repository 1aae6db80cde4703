"""What vLLM's incremental detokenizer costs on the benches' random-weight completions.

    python bench/detokenize_cost.py [--completions 16] [--tokens 512] [--out FILE]

The GPU benches give their random-weight models the arith tokenizer (runtime/tasks/arith): one
id per character, then `<unused_N>` filler up to Qwen3's 151,936 ids, decoded to nothing. A
random-weight model samples nearly uniformly over the vocabulary, so almost every completion
token is filler. vLLM's fast incremental detokenizer (vllm/v1/engine/detokenizer.py) feeds each
new token to tokenizers' `DecodeStream.step`, which keeps its window of ids until the decoded
text grows: with filler that decodes to "", the window keeps the whole prompt and completion,
and each step decodes all of it again. This times that loop, the prompt given as the stream's
prefill as vLLM gives it, for completions of filler-heavy ids (drawn as a random model draws
them) and of characters only, and scales the time to 128 completions a step, the benches' work.

Ours and the TRL bench generate without detokenizing (no tokenizer in the engine, or
`detokenize=False`); verl's vLLM server detokenizes unless bench/verl_grpo.py turns it off.
The figures are this host's CPU, one thread, as vLLM's output processing runs on one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from recipes.architectures import QWEN3_VOCAB as VOCAB  # noqa: E402  (as trl_grpo.py pads it)

STEP_COMPLETIONS = 128  # 16 prompts x 8 completions


def completion(rng: random.Random, tokens: int, characters: range, filler: bool) -> list[int]:
    """Ids as a random-weight model samples them (uniform over the vocabulary) or characters."""
    if filler:
        return [rng.randrange(VOCAB) for _ in range(tokens)]
    return [rng.choice(characters) for _ in range(tokens)]


def time_stream(core, prompt: list[int], ids: list[int]) -> float:
    """Seconds to detokenize `ids` one at a time after `prompt`, as vLLM's fast path does."""
    from tokenizers.decoders import DecodeStream

    start = time.perf_counter()
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    for token in ids:
        stream.step(core, token)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--completions", type=int, default=16, help="timed completions a kind")
    p.add_argument("--tokens", type=int, default=512, help="tokens a completion")
    p.add_argument("--prompt-tokens", type=int, default=207)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a JSON file (default: print only)")
    args = p.parse_args(argv)
    import tokenizers

    from runtime.tasks.arith.tokenization import CHARACTERS, build_tokenizer

    tokenizer = build_tokenizer(VOCAB)
    core = tokenizer._tokenizer  # the tokenizers.Tokenizer vLLM's fast path steps
    prompt = tokenizer("x" * (args.prompt_tokens - 1))["input_ids"]
    characters = range(3, 3 + len(CHARACTERS))
    rng = random.Random(args.seed)
    kinds = {}
    for name, filler in (("random_weights", True), ("characters_only", False)):
        batch = [completion(rng, args.tokens, characters, filler) for _ in range(args.completions)]
        seconds = sum(time_stream(core, prompt, ids) for ids in batch)
        visible = sum(1 for ids in batch for t in ids if t in characters)
        kinds[name] = {
            "seconds": round(seconds, 4),
            "seconds_per_completion": round(seconds / args.completions, 5),
            "seconds_for_a_step": round(seconds / args.completions * STEP_COMPLETIONS, 2),
            "visible_token_share": round(visible / (args.completions * args.tokens), 5),
        }
    result = {
        "what": "vLLM's incremental detokenization (tokenizers DecodeStream.step) of the benches' "
        f"completions, {args.tokens} tokens after a {len(prompt)}-token prompt, one thread",
        "completions_timed": args.completions,
        "step_completions": STEP_COMPLETIONS,
        "kinds": kinds,
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or None,
        },
        "versions": {"python": platform.python_version(), "tokenizers": tokenizers.__version__},
        "date": time.strftime("%Y-%m-%d"),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
