"""The tiny-tools tokenizer: Qwen3's chat layout and tool-call format over a vocabulary of a
few dozen tokens, built locally.

A character-level vocabulary (digits, the keys a to c, newline) plus single tokens for the
template's markers and for each whole lookup call (`<tool_call>\\n{"name": "lookup",
"arguments": {"key": "a"}}\\n</tool_call>`, one per key), the way a BPE vocabulary trained
on such calls would merge them: a policy sampling from random weights then makes a call now
and then, and GRPO can take it from there (spelled out in JSON, a call would be dozens of
tokens no random policy ever writes). The template writes the tools' names in a system turn, calls in `<tool_call>`
blocks, results as `<tool_response>` blocks in a user turn, as Qwen3's does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, START, END, UNK = "<pad>", "<|im_start|>", "<|im_end|>", "<unk>"
KEYS = "abc"


def call_text(key: str) -> str:
    """A lookup call as Qwen3 writes it (and the template renders it)."""
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'


MARKERS = (
    *(call_text(k) for k in KEYS),
    "<tool_response>",
    "</tool_response>",
    "system",
    "user",
    "assistant",
    "lookup",
)
CHARACTERS = "0123456789" + KEYS + "\n"

CHAT_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\\n' }}"
    "{%- for t in tools -%}{{ (t.function or t).name }}{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] -%}"
    "{%- set f = c.function or c -%}"
    '{{ \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' }}'
    "{{ f.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """<pad>=0, <|im_start|>=1, <|im_end|>=2 (the end of a turn: EOS), <unk>=3, then the
    characters, then the markers."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = [PAD, START, END, UNK, *CHARACTERS]
    vocab = {s: i for i, s in enumerate(symbols)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in (PAD, START, END, UNK)])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=START,
        eos_token=END,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
    )
