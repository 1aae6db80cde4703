"""Reward functions `fn(prompt, completion, answer) -> float` and the recipe's reward mix.

A recipe names each reward as one of:
- "math": 1.0 when the completion's final answer (`<answer>`, `\\boxed{}` or `####`) equals the
  gold number (GSM8K style), else 0.0;
- "gsm8k_format": credit for GSM8K's answer layout, the reasoning and then a last line
  `#### <number>` (what the GSM8K recipes' prompt asks for);
- "format": credit for the `<think>...</think><answer>...</answer>` layout (DeepSeek-R1 style
  prompts that ask for those tags);
- "builtin:<name>": the reward of a task forgesky ships (runtime/tasks/registry.py);
- "module:function": a user function, imported with importlib.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

from recipes.errors import UserError

RewardFn = Callable[[str, str, str], float]

# ---------------------------------------------------------------- math

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*(?:\d+(?:\.\d*)?|\.\d+))?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]+?)\s*\}\s*\{\s*([^{}]+?)\s*\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####[ \t]*([^\n<]*)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _last_boxed(text: str) -> tuple[int, str] | None:
    """Position and content of the last `\\boxed{...}`, balancing nested braces."""
    start = text.rfind("\\boxed")
    while start != -1:
        open_at = text.find("{", start)
        if open_at != -1 and text[start + len("\\boxed") : open_at].strip() == "":
            depth = 0
            for i in range(open_at, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return start, text[open_at + 1 : i]
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_answer(completion: str) -> str | None:
    """The completion's final answer: the last `<answer>...</answer>`, `\\boxed{...}` or
    `#### ...` (GSM8K's own marker, to the end of its line), whichever comes last."""
    candidates = [(m.start(), m.group(1)) for m in _ANSWER_TAG.finditer(completion)][-1:]
    candidates += [(m.start(), m.group(1)) for m in _HASHES.finditer(completion)][-1:]
    boxed = _last_boxed(completion)
    if boxed is not None:
        candidates.append(boxed)
    if not candidates:
        return None
    return max(candidates)[1].strip()


def gold_answer(answer: str) -> str:
    """The gold answer: the text after GSM8K's final `####`, or the whole string."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def parse_number(text: str) -> float | None:
    """A number written the ways models and GSM8K write them, or None.

    Handles `$`, thousands commas, `%`, a trailing `.`, fractions (`3/4`, `\\frac{3}{4}`),
    negatives (also the unicode minus) and units after the number (`18 dollars`). Text holding
    several numbers (`17 or 18`) is ambiguous and gives None.
    """
    s = text.replace("\u2212", "-").replace("{,}", ",")
    s = _TEXT.sub(" ", s)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = re.sub(r"\\[$%]|[$%]|\\!|\\,", "", s)
    s = _THOUSANDS.sub("", s)
    s = s.replace("(", "").replace(")", "")
    numbers = _NUMBER.findall(s)
    if len(numbers) != 1:
        return None
    token = re.sub(r"\s+", "", numbers[0])
    try:
        if "/" in token:
            num, den = token.split("/")
            value = Fraction(num.rstrip(".")) / Fraction(den.rstrip("."))
            return float(value)
        return float(token.rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the gold answer numerically, else 0.0.

    Numbers match within a relative tolerance of 1e-4 (so 0.3333 matches 1/3); a gold answer that
    is not a number is compared as text, ignoring whitespace and case.
    """
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    gold = gold_answer(answer)
    gold_value = parse_number(gold)
    if gold_value is None:
        return float(gold != "" and _squash(predicted) == _squash(gold))
    value = parse_number(predicted)
    if value is None:
        return 0.0
    return float(math.isclose(value, gold_value, rel_tol=1e-4, abs_tol=1e-6))


# ---------------------------------------------------------------- format

_STRICT_FORMAT = re.compile(
    r"\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL
)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(prompt: str, completion: str, answer: str) -> float:
    """Credit for `<think>...</think>` followed by `<answer>...</answer>`.

    - 1.0: exactly that and nothing else around it, each tag once, a non-empty answer;
    - 0.5: both blocks, in that order, but with other text around them or repeated tags;
    - 0.25: only one of the two blocks, closed;
    - 0.0: otherwise.
    When the prompt ends with `<think>` (chat templates that open the thinking block), the
    completion is read as continuing it.
    """
    if prompt.rstrip().endswith("<think>") and not completion.lstrip().startswith("<think>"):
        completion = "<think>" + completion
    strict = _STRICT_FORMAT.fullmatch(completion)
    once = all(completion.count(tag) == 1 for tag in _TAGS)
    if strict and once and strict.group("answer").strip():
        return 1.0
    think = re.search(r"<think>.*?</think>", completion, re.DOTALL)
    answer_block = _ANSWER_TAG.search(completion, think.end() if think else 0)
    if think and answer_block:
        return 0.5
    if think or _ANSWER_TAG.search(completion):
        return 0.25
    return 0.0


_THINK_BLOCK = re.compile(r"\s*<think>.*?</think>", re.DOTALL)


def gsm8k_format_reward(prompt: str, completion: str, answer: str) -> float:
    """Credit for GSM8K's answer layout: reasoning, then `#### <number>` ending the completion.

    - 1.0: some text before it, `####` once, one number after it and nothing else to the end
      (units and `$` around the number are fine);
    - 0.5: a `####` line with one number, but with text after it or other `####` lines;
    - 0.0: otherwise.
    A leading `<think>...</think>` block (Qwen3 with thinking on) is the model's own and is
    read past: the layout is judged on the answer after it.
    """
    body = (
        _THINK_BLOCK.sub("", completion, count=1)
        if completion.lstrip().startswith("<think>")
        else completion
    )
    lines = [line for line in body.strip().splitlines() if line.strip()]
    marked = [i for i, line in enumerate(lines) if "####" in line]
    if not marked:
        return 0.0
    last = lines[marked[-1]]
    number = parse_number(last.split("####", 1)[1])
    if number is None:
        return 0.0
    reasoning = "\n".join(lines[: marked[-1]]) + last.split("####", 1)[0]
    ends = marked[-1] == len(lines) - 1
    if ends and len(marked) == 1 and body.count("####") == 1 and reasoning.strip():
        return 1.0
    return 0.5


# ---------------------------------------------------------------- resolution

_NAMED: dict[str, RewardFn] = {
    "math": math_reward,
    "gsm8k_format": gsm8k_format_reward,
    "format": format_reward,
}


def _builtin(spec: str, name: str) -> RewardFn:
    from runtime.tasks.registry import shipped_task

    task = shipped_task(name, field="reward")
    if task.reward is None:
        raise UserError(f"reward {spec!r}: the shipped task {name!r} has no reward of its own")
    return task.reward


def _imported(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"reward {spec!r}: expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name or module_name.startswith(f"{e.name}."):
            raise UserError(f"reward {spec!r}: module {module_name!r} not found") from None
        raise UserError(f"reward {spec!r}: importing module {module_name!r} failed: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    if not callable(fn):
        raise UserError(f"reward {spec!r}: {module_name}.{attr} is not callable")
    return fn


def resolve_reward(spec: str) -> RewardFn:
    """The reward function a recipe's reward name stands for; UserError when it cannot be found."""
    if spec in _NAMED:
        return _NAMED[spec]
    if spec.startswith("builtin:"):
        return _builtin(spec, spec.removeprefix("builtin:"))
    if ":" in spec:
        return _imported(spec)
    raise UserError(
        f"reward {spec!r}: unknown reward; use 'math', 'gsm8k_format', 'format', "
        "'builtin:<name>' or 'module:function'"
    )


def _name_weight(spec: Any) -> tuple[str, float]:
    if isinstance(spec, (tuple, list)):
        name, weight = spec
    elif isinstance(spec, dict):
        name, weight = spec["name"], spec.get("weight", 1.0)
    else:
        name, weight = spec.name, spec.weight
    return str(name), float(weight)


class RewardMix:
    """Weighted sum of rewards: `mix(prompt, completion, answer) -> (total, {name: score})`.

    The per-name scores are unweighted, so they read the same whatever the weights.
    """

    def __init__(self, specs: Iterable[Any]):
        self.weights: dict[str, float] = {}
        self.fns: dict[str, RewardFn] = {}
        for spec in specs:
            name, weight = _name_weight(spec)
            if name in self.fns:
                raise UserError(f"reward {name!r} is listed twice in dataset.rewards")
            self.fns[name] = resolve_reward(name)
            self.weights[name] = weight
        if not self.fns:
            raise UserError("dataset.rewards is empty: name at least one reward")

    def __call__(self, prompt: str, completion: str, answer: str) -> tuple[float, dict[str, float]]:
        scores: dict[str, float] = {}
        for name, fn in self.fns.items():
            value = fn(prompt, completion, answer)
            try:
                scores[name] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"reward {name!r} returned {value!r}, not a number") from None
        total = sum(self.weights[name] * score for name, score in scores.items())
        return total, scores


def build_reward_fn(specs: Iterable[Any]) -> RewardMix:
    """The recipe's reward mix from `(name, weight)` pairs, `{"name", "weight"}` dicts or objects
    with `.name` and `.weight` (the recipe's `dataset.rewards` entries).

    Every name is resolved now, so a missing module fails before training starts.
    """
    return RewardMix(specs)
