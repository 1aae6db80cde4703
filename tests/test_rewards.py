"""Reward functions: GSM8K-style answer matching, the format reward, resolution and the mix."""

import sys
import textwrap
from types import SimpleNamespace

import pytest

from recipes.errors import UserError
from runtime.tasks.rewards import (
    build_reward_fn,
    extract_answer,
    format_reward,
    gsm8k_format_reward,
    math_reward,
    parse_number,
    resolve_reward,
)

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


# ---------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("<think>48+24</think><answer>72</answer>", GSM8K_GOLD, 1.0),
        ("<think>48+24</think><answer>73</answer>", GSM8K_GOLD, 0.0),
        ("so the total is \\boxed{72}.", GSM8K_GOLD, 1.0),
        ("<answer>72</answer>", "72", 1.0),
        ("<answer> 72 </answer>", "#### 72", 1.0),
        ("<answer>$1,234</answer>", "#### 1234", 1.0),
        ("<answer>1234</answer>", "#### 1,234", 1.0),
        ("<answer>\\$18</answer>", "#### 18", 1.0),
        ("<answer>18 dollars</answer>", "#### 18", 1.0),
        ("<answer>\\boxed{18 \\text{ dollars}}</answer>", "#### 18", 1.0),
        ("<answer>50%</answer>", "#### 50", 1.0),
        ("<answer>50\\%</answer>", "#### 50", 1.0),
        ("<answer>42.</answer>", "#### 42", 1.0),
        ("<answer>42.0</answer>", "#### 42", 1.0),
        ("<answer>42.50</answer>", "#### 42.5", 1.0),
        ("<answer>.5</answer>", "#### 0.5", 1.0),
        ("<answer>3/4</answer>", "#### 0.75", 1.0),
        ("<answer>0.75</answer>", "#### 3/4", 1.0),
        ("\\boxed{\\frac{3}{4}}", "#### 0.75", 1.0),
        ("\\boxed{\\dfrac{1}{3}}", "#### 0.3333", 1.0),
        ("<answer>0.33</answer>", "#### 1/3", 0.0),
        ("<answer>-5</answer>", "#### -5", 1.0),
        ("<answer>\u22125</answer>", "#### -5", 1.0),
        ("<answer>-$5</answer>", "#### -5", 1.0),
        ("<answer>5</answer>", "#### -5", 0.0),
        ("<answer>1{,}000</answer>", "#### 1000", 1.0),
        ("<answer>1,000,000</answer>", "#### 1000000", 1.0),
        ("<answer>x = 7</answer>", "#### 7", 1.0),
        # several numbers are ambiguous, not "the last one"
        ("<answer>17 or 18</answer>", "#### 18", 0.0),
        ("<answer>1,2,3</answer>", "#### 123", 0.0),
        # the last answer wins, whether tag or box
        ("<answer>3</answer> wait, no: <answer>4</answer>", "#### 4", 1.0),
        ("<answer>4</answer> wait, no: <answer>3</answer>", "#### 4", 0.0),
        ("\\boxed{3} hmm <answer>4</answer>", "#### 4", 1.0),
        ("<answer>4</answer> hmm \\boxed{3}", "#### 4", 0.0),
        ("\\boxed{2} then \\boxed{5}", "#### 5", 1.0),
        # GSM8K's own marker, which the catalog's default prompt template asks for
        ("48 + 24 = 72\n#### 72", GSM8K_GOLD, 1.0),
        ("#### 72\nActually no.\n#### 71", GSM8K_GOLD, 0.0),
        ("<answer>#### 72</answer>", GSM8K_GOLD, 1.0),
        ("#### 70 <answer>72</answer>", GSM8K_GOLD, 1.0),
        ("\\boxed{\\frac{10}{2}}", "#### 5", 1.0),
        # no final answer at all, or an unclosed one, earns nothing
        ("The answer is 72.", GSM8K_GOLD, 0.0),
        ("<answer>72", GSM8K_GOLD, 0.0),
        ("", GSM8K_GOLD, 0.0),
        ("<answer></answer>", "#### 0", 0.0),
        ("<answer>0</answer>", "#### 0", 1.0),
        ("<answer>1/0</answer>", "#### 0", 0.0),
        # non-numeric gold falls back to text comparison
        ("<answer>Paris</answer>", "#### paris", 1.0),
        ("<answer>Lyon</answer>", "#### Paris", 0.0),
    ],
)
def test_math_reward(completion, gold, expected):
    assert math_reward("What is it?", completion, gold) == expected


def test_math_reward_is_float():
    assert isinstance(math_reward("", "<answer>1</answer>", "1"), float)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,234.5", 1234.5),
        ("$-3", -3.0),
        ("-3/4", -0.75),
        ("\\frac{-1}{2}", -0.5),
        ("1\\,000", 1000.0),
        ("about", None),
        ("2 3", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_extract_answer_balances_braces_in_boxed():
    assert extract_answer("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert extract_answer("no answer here") is None


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>add them</think><answer>72</answer>", 1.0),
        ("  <think>\nadd\n</think>\n\n<answer>72</answer>\n", 1.0),
        ("<think>add</think><answer> </answer>", 0.5),
        ("Sure! <think>add</think><answer>72</answer>", 0.5),
        ("<think>add</think><answer>72</answer> Done.", 0.5),
        ("<think>a</think><think>b</think><answer>72</answer>", 0.5),
        ("<answer>72</answer><think>after</think>", 0.25),
        ("<answer>72</answer>", 0.25),
        ("<think>add</think> 72", 0.25),
        ("<think>add them", 0.0),
        ("72", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward("Q", completion, "72") == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72", 1.0),
        ("48 + 24 = 72\n\n####   72  \n", 1.0),
        ("So she has 72 clips. #### 72", 1.0),  # the marker after the reasoning, on its line
        ("<think>\n#### 70? no\n</think>\n\n48 + 24 = 72\n#### 72", 1.0),  # thinking read past
        ("48 + 24 = 72\n#### $72", 1.0),
        ("#### 72", 0.0 + 0.5),  # no reasoning before it
        ("48 + 24 = 72\n#### 72\nHope this helps!", 0.5),  # text after the answer line
        ("#### 70\n48 + 24 = 72\n#### 72", 0.5),  # two answers
        ("48 + 24 = 72\n#### 70 or 72", 0.0),  # no single number
        ("48 + 24 = 72. The answer is 72.", 0.0),
        ("<think>48 + 24 = 72\n#### 72</think>", 0.0),  # only inside the thinking
    ],
)
def test_gsm8k_format_reward(completion, expected):
    assert gsm8k_format_reward("Q", completion, "#### 72") == expected


def test_format_reward_reads_completion_as_continuing_an_opened_think_block():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert format_reward(prompt, "add them</think><answer>72</answer>", "72") == 1.0
    assert format_reward(prompt, "<think>add</think><answer>72</answer>", "72") == 1.0


# ---------------------------------------------------------------- resolution


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(
        textwrap.dedent(
            """
            import math
            SCALE = 3
            def length(prompt, completion, answer):
                return len(completion) / 10
            def bad(prompt, completion, answer):
                return "high"
            """
        )
    )
    (tmp_path / "needsdep.py").write_text("import forgesky_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "myrewards"
    for name in ("myrewards", "needsdep"):
        sys.modules.pop(name, None)


def test_resolves_named_and_user_rewards(user_module):
    assert resolve_reward("math") is math_reward
    assert resolve_reward("format") is format_reward
    assert resolve_reward("myrewards:length")("q", "abcde", "a") == 0.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nosuchmod:fn", "reward 'nosuchmod:fn': module 'nosuchmod' not found"),
        ("nosuchpkg.sub:fn", "reward 'nosuchpkg.sub:fn': module 'nosuchpkg.sub' not found"),
        (
            "myrewards:missing",
            "reward 'myrewards:missing': module 'myrewards' has no function 'missing'",
        ),
        ("myrewards:SCALE", "reward 'myrewards:SCALE': myrewards.SCALE is not callable"),
        (
            "needsdep:fn",
            "importing module 'needsdep' failed: No module named 'forgesky_missing_dependency'",
        ),
        ("myrewards:", "expected 'module:function'"),
        ("accuracy", "reward 'accuracy': unknown reward"),
        (
            "builtin:nosuchtask",
            "reward 'builtin:nosuchtask': no shipped task named 'nosuchtask' (shipped: tiny, arith, tiny-tools)",
        ),
    ],
)
def test_unresolvable_rewards_are_one_line_user_errors(user_module, spec, message):
    with pytest.raises(UserError) as info:
        resolve_reward(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_builtin_rewards_are_the_shipped_tasks_own():
    assert resolve_reward("builtin:tiny")("123", "456", "456") == 1.0
    with pytest.raises(
        UserError, match=r"no shipped task named 'other' \(shipped: tiny, arith, tiny-tools\)"
    ):
        resolve_reward("builtin:other")
    with pytest.raises(UserError, match=r"the shipped task 'arith' has no reward of its own"):
        resolve_reward("builtin:arith")


def test_the_registry_ships_exactly_the_tasks_recipes_know():
    from recipes.names import BUILTIN_TASKS
    from runtime.tasks.registry import _LOADERS, shipped_task

    assert tuple(_LOADERS) == BUILTIN_TASKS
    for name in BUILTIN_TASKS:
        assert shipped_task(name, field="dataset.path").name == name


# ---------------------------------------------------------------- the mix


def test_build_reward_fn_weighted_sum_with_unweighted_parts():
    mix = build_reward_fn([("math", 1.0), ("format", 0.5)])
    total, parts = mix("Q", "<think>48+24</think><answer>72</answer>", GSM8K_GOLD)
    assert parts == {"math": 1.0, "format": 1.0}
    assert total == 1.5
    total, parts = mix("Q", "<answer>70</answer>", GSM8K_GOLD)
    assert parts == {"math": 0.0, "format": 0.25}
    assert total == 0.125


def test_build_reward_fn_accepts_recipe_entries_and_dicts(user_module):
    entries = [SimpleNamespace(name="myrewards:length", weight=2.0), {"name": "math"}]
    total, parts = build_reward_fn(entries)("q", "<answer>1</answer>", "1")
    assert parts == {"myrewards:length": 1.8, "math": 1.0}
    assert total == pytest.approx(2 * 1.8 + 1.0)


def test_build_reward_fn_fails_early(user_module):
    with pytest.raises(UserError, match="module 'nosuchmod' not found"):
        build_reward_fn([("math", 1.0), ("nosuchmod:fn", 1.0)])
    with pytest.raises(UserError, match="listed twice"):
        build_reward_fn([("math", 1.0), ("math", 2.0)])
    with pytest.raises(UserError, match="empty"):
        build_reward_fn([])


def test_reward_returning_a_non_number_is_named(user_module):
    mix = build_reward_fn([("myrewards:bad", 1.0)])
    with pytest.raises(TypeError, match="reward 'myrewards:bad' returned 'high'"):
        mix("q", "c", "a")


# ------------------------------------------- the GSM8K recipes, prompt to reward, per family

# Chat templates that render like each family's own (roles, generation prompt, and Qwen3's
# enable_thinking=false closing an empty think block); the tokenizer is the shipped character
# one, so no download is needed.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "\n\n{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# What each family writes for the first GSM8K training problem when it does as the prompt asks.
ANSWERS = {
    "qwen3": "Natalia sold 48 / 2 = 24 clips in May.\nIn total she sold 48 + 24 = 72 clips.\n#### 72",
    "qwen3-thinking": (
        "<think>\nApril 48, May half of that, 24. 48 + 24 = 72.\n</think>\n\n"
        "In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 in April and May.\n#### 72"
    ),
    "llama3": (
        "Step 1: In May, Natalia sold 48 / 2 = 24 clips.\n"
        "Step 2: Altogether she sold 48 + 24 = 72 clips.\n\n#### 72"
    ),
}


@pytest.mark.parametrize(
    ("recipe_name", "thinking", "answer", "prompt_ends"),
    [
        ("qwen3-1.7b", None, "qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("qwen3-8b", None, "qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("qwen3-8b", True, "qwen3-thinking", "<|im_start|>assistant\n"),
        ("llama3.1-8b", None, "llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        ("llama3.2-1b", None, "llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ],
)
def test_a_perfect_answer_earns_the_full_reward_through_the_recipes_chat_template(
    recipe_name, thinking, answer, prompt_ends
):
    from recipes import apply_overrides, load_recipe
    from runtime.backends import build
    from runtime.tasks.arith import tokenizer as char_tokenizer
    from runtime.tasks.data import PromptSource

    recipe = load_recipe(recipe_name)
    if thinking is not None:
        recipe = apply_overrides(recipe, [f"model.thinking={str(thinking).lower()}"])
    tok = char_tokenizer(build.model_spec(recipe).vocab_size)
    tok.chat_template = QWEN3_TEMPLATE if recipe.model.family == "qwen3" else LLAMA3_TEMPLATE
    row = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold "
           "half as many clips in May. How many clips did Natalia sell altogether in April and "
           "May?", "answer": GSM8K_GOLD}  # fmt: skip
    source = PromptSource.for_dataset([row], recipe.dataset)
    prompt = source.prompt(0)
    assert "####" in prompt.text  # the prompt asks for the layout the rewards pay for
    ids = build.encode_messages(
        tok, prompt.messages(), recipe.grpo.max_prompt_tokens, recipe.model.thinking
    )
    assert tok.decode(ids, skip_special_tokens=True).endswith(prompt_ends)
    # the completion as the generator returns it: token ids to eos, decoded without specials
    response = tok(ANSWERS[answer], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    completion = tok.decode(response, skip_special_tokens=True)
    total, parts = build_reward_fn(recipe.dataset.rewards)(prompt.text, completion, prompt.answer)
    weights = {r.name: r.weight for r in recipe.dataset.rewards}
    assert parts == {name: 1.0 for name in weights}
    assert total == pytest.approx(sum(weights.values()))
    # and the recipe's evaluation counts it correct
    assert parts[recipe.eval.reward or recipe.dataset.rewards[0].name] >= recipe.eval.correct_at
