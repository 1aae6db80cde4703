"""`forgesky eval` of an SFT model where its recipe names a reward (`eval.reward`): completions
of held-out chats sampled and scored as a GRPO run's evaluations are (greedy pass@1, pass@k from
the samples; runtime.control.evaluation), with the HF generator in this process.

Each of the first `eval.prompts` held-out rows gives a prompt and its answer: the turns before
its last assistant turn are the prompt (through the chat template, with the generation prompt),
that turn's content is the answer the reward is given (a GSM8K solution ending `#### 42`, the
digits of tiny-sft's count)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from recipes import UserError
from recipes.sft_rows import conversation


def held_out_prompts(recipe: Any) -> tuple[list[Any], list[list[dict[str, str]]]]:
    """The first eval.prompts held-out rows as prompts (the last user turn's text, the answer)
    and the turns each is generated from."""
    from runtime.sft.run import load_rows
    from runtime.tasks.data import Prompt

    e, d = recipe.eval, recipe.dataset
    rows = load_rows(d, e.path or d.path, e.split, "eval.path")
    prompts, turns = [], []
    for i in range(min(e.prompts, len(rows))):
        messages = conversation(rows[i], d)
        last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
        before = messages[:last]
        if not any(m["role"] == "user" for m in before):
            raise UserError(
                f"eval.reward: held-out row {i} has no user turn before its last assistant "
                "turn: nothing to prompt with"
            )
        user = next(m for m in reversed(before) if m["role"] == "user")
        prompts.append(Prompt(i, str(user["content"]), str(messages[last]["content"])))
        turns.append(before)
    return prompts, turns


def evaluate(
    recipe: Any, weights: Mapping[str, Any], log: Callable[[str], None] = print
) -> dict[str, float]:
    """Greedy and sampled completions of the held-out prompts under `weights` (HF names),
    scored by eval.reward: eval/pass@1, eval/reward_mean, eval/mean@n and eval/pass@k (k > 1),
    eval/prompts."""
    from runtime.backends import HFGenerator
    from runtime.backends.build import (
        device,
        dtype,
        encode_messages,
        eos_ids,
        load_tokenizer,
        model_spec,
        pad_id,
    )
    from runtime.control.evaluation import judge, needs_samples, score_items, summarize
    from runtime.tasks.rewards import build_reward_fn

    e = recipe.eval
    reward = build_reward_fn([(e.reward, 1.0)])  # a module:function is imported here
    prompts, turns = held_out_prompts(recipe)
    tokenizer = load_tokenizer(recipe)
    spec = model_spec(recipe)
    ids = [
        encode_messages(tokenizer, t, recipe.dataset.max_tokens, recipe.model.thinking)
        for t in turns
    ]
    longest = max(len(i) for i in ids)
    if longest + e.max_new_tokens > spec.max_seq_len:
        raise UserError(
            f"eval.max_new_tokens: {e.max_new_tokens} after a prompt of {longest} tokens passes "
            f"the model's context of {spec.max_seq_len}; lower it"
        )
    start = time.perf_counter()
    generator = HFGenerator(
        spec,
        eos_token_id=eos_ids(tokenizer),
        pad_token_id=pad_id(tokenizer),
        device=device(),
        dtype=dtype(recipe),
        seed=recipe.sft.seed,
    )
    generator.load_weights(weights)

    def texts(n: int, temperature: float) -> list[str]:
        out = generator.generate(
            ids,
            n=n,
            max_new_tokens=e.max_new_tokens,
            temperature=temperature,
            seed=recipe.sft.seed,
            logprobs=False,
        )
        return [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in out]

    greedy = texts(1, 0.0)
    sampled = texts(e.samples_drawn, e.temperature) if needs_samples(e) else []
    scores = [reward(*item) for item in score_items(prompts, greedy, sampled)]
    metrics = summarize(judge(scores, len(prompts), e, e.reward), e)
    metrics["eval/sample_seconds"] = time.perf_counter() - start
    log(
        f"{e.reward}: pass@1 {metrics['eval/pass@1']:.3g}"
        + (f", pass@{e.k} {metrics[f'eval/pass@{e.k}']:.3g}" if e.k > 1 else "")
        + f" over {len(prompts)} prompts"
        + (f" ({e.samples_drawn} samples each)" if sampled else "")
    )
    return metrics
