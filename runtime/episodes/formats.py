"""Tool calls in a model family's own chat format: the opening prompt (the tools rendered by the
tokenizer's chat template), the model's turn parsed into calls, and the tokens a tool's result
adds to the conversation.

Qwen3 (Hermes style): the template lists the tools in the system turn; the assistant writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks and ends its turn with
`<|im_end|>`; each result is a `tool` message, rendered as a `<tool_response>` block inside a
user turn. Llama 3.1: the assistant's turn is a JSON object `{"name": ..., "parameters": {...}}`
(several joined by ";"), each result an `ipython` message.

The model's turn is never re-rendered: its sampled tokens stay as they were, so the training
sequence is exactly what the policy saw and produced. What follows a turn is the difference
between two renderings of the template (a short chat, then the same chat with the tool messages
and the generation prompt): the tail the template writes after the turn's end token, the tool
messages, the next assistant header. Those tokens are the environment's and the template's:
never trained on.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.environments.api import ToolCall

# What a user turn and an assistant turn of the probe chat hold (any text the template keeps).
_PROBE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn read: its tool calls, the text outside them, and why it could not be read
    (None when it could); a malformed turn carries no call."""

    calls: tuple[ToolCall, ...]
    content: str
    malformed: str | None = None


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (a Mapping), 4 a list of ids
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def _call(obj: Any, arguments_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a tool call is an object with a non-empty string 'name'")
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"'{arguments_key}' must be an object")
    return ToolCall(obj["name"], args)


class ToolFormat(ABC):
    """One family's tool-call format, over a tokenizer that has its chat template."""

    family = ""
    tool_role = "tool"  # the role of a result message
    turn_end = ""  # the token text that ends an assistant turn

    def __init__(self, tokenizer: Any, thinking: bool | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{self.family} tool calls need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.extra = {} if thinking is None else {"enable_thinking": thinking}
        # a chat of one exchange as the template writes it (what result messages extend)
        self._base = self.render(_PROBE)
        self._tail = self._turn_tail()

    # --- rendering ------------------------------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        generation_prompt: bool = False,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.extra,
        )

    def encode(self, text: str) -> list[int]:
        return _ids(self.tokenizer(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The episode's opening: its messages and tools as the template writes them, with the
        assistant's generation prompt."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def _turn_tail(self) -> str:
        """What the template writes after an assistant turn's end token (ChatML: a newline)."""
        text = self._base
        at = text.rfind(self.turn_end) if self.turn_end else -1
        return "" if at < 0 else text[at + len(self.turn_end) :]

    def result_message(self, text: str) -> dict[str, Any]:
        return {"role": self.tool_role, "content": text}

    def observation_ids(self, results: list[str], turn_closed: bool) -> list[int]:
        """The tokens that follow a turn whose calls gave `results`: the end of the turn (its end
        token too where the model did not write it: `turn_closed` False), the result messages
        and the next assistant header."""
        base = self._base
        full = self.render([*_PROBE, *map(self.result_message, results)], generation_prompt=True)
        if not full.startswith(base):
            raise ValueError(f"the {self.family} chat template does not extend a chat as it grows")
        head = self._tail if turn_closed else self.turn_end + self._tail
        return self.encode(head + full[len(base) :])

    # --- parsing --------------------------------------------------------------------------------

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The family's own tool-call syntax (Qwen3Format, Llama3Format)."""


class Qwen3Format(ToolFormat):
    family = "qwen3"
    tool_role = "tool"
    turn_end = "<|im_end|>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        text = text.split(self.turn_end, 1)[0]
        content = self._block.sub("", text).strip()
        if "<tool_call>" not in text and "</tool_call>" not in text:
            return ParsedTurn((), content)
        if text.count("<tool_call>") != text.count("</tool_call>"):
            return ParsedTurn((), content, "an unclosed <tool_call> block")
        calls = []
        for body in self._block.findall(text):
            try:
                calls.append(_call(json.loads(body), "arguments"))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                return ParsedTurn((), content, f"tool call {body.strip()[:80]!r}: {e}")
        return ParsedTurn(tuple(calls), content)


class Llama3Format(ToolFormat):
    family = "llama3"
    tool_role = "ipython"
    turn_end = "<|eot_id|>"

    def parse(self, text: str) -> ParsedTurn:
        for end in ("<|eot_id|>", "<|eom_id|>"):
            text = text.split(end, 1)[0]
        body = text.strip()
        if not body.startswith("{"):
            return ParsedTurn((), body)
        calls, at, decoder = [], 0, json.JSONDecoder()
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
                calls.append(_call(obj, "parameters"))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                return ParsedTurn((), "", f"tool call {body[at:][:80]!r}: {e}")
            at = end
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return ParsedTurn(tuple(calls), "")


FORMATS: dict[str, type[ToolFormat]] = {"qwen3": Qwen3Format, "llama3": Llama3Format}


def tool_format(family: str, tokenizer: Any, thinking: bool | None = None) -> ToolFormat:
    """The tool-call format of a model family (recipes' `model.family`)."""
    try:
        return FORMATS[family](tokenizer, thinking)
    except KeyError:
        raise ValueError(
            f"no tool-call format for family {family!r}; known: {', '.join(FORMATS)}"
        ) from None
