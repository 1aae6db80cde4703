"""The `arith` task: Hub-free prompts and tokenizer for random-weight runs of real recipes."""

from __future__ import annotations

from recipes import apply_overrides, load_recipe
from runtime.backends import build as services
from runtime.tasks.arith import rows
from runtime.tasks.data import build_prompt_source
from runtime.tasks.rewards import build_reward_fn

OFFLINE = ["model.init=random", "model.tokenizer=builtin:arith", "dataset.path=builtin:arith"]


def test_a_gsm8k_recipe_runs_on_arith_prompts_and_its_rewards():
    recipe = apply_overrides(load_recipe("qwen3-1.7b"), OFFLINE)
    prompts = build_prompt_source(recipe.dataset, seed=0).take(3)
    assert all(p.text.endswith('output the final answer after "####".') for p in prompts)
    rewards = build_reward_fn([r.model_dump() for r in recipe.dataset.rewards])
    for p in prompts:
        worked = p.answer  # GSM8K-style: reasoning, then "#### N"
        assert rewards(p.text, worked, p.answer)[1]["math"] == 1.0
        assert rewards(p.text, "#### -1", p.answer)[1]["math"] == 0.0
    assert rows(count=5) == rows(count=5) and rows(count=5, seed=1) != rows(count=5)
    assert not {r["question"] for r in rows("test")} & {r["question"] for r in rows()}


def test_tokenizer_covers_the_model_vocabulary():
    recipe = apply_overrides(load_recipe("qwen3-1.7b"), OFFLINE)
    tok = services.load_tokenizer(recipe)
    assert len(tok) == services.model_spec(recipe).vocab_size == 151936
    text = rows(count=1)[0]["question"]
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    blank_lines = "a\n\n\nb"  # one id a character, newlines too
    assert tok.decode(tok(blank_lines)["input_ids"], skip_special_tokens=True) == blank_lines
    # any id a random-weight model samples decodes; filler decodes to nothing
    assert (
        tok.decode([ids[1], 151935, 100_000, tok.eos_token_id], skip_special_tokens=True) == text[0]
    )
    assert services.eos_ids(tok) == [2] and services.pad_id(tok) == 0
