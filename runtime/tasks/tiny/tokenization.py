"""The tiny task's tokenizer: one token per character, built locally (no download)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"

# The tiny tokenizer's chat template: a turn of the user (or system) is <bos> and its text, an
# assistant's turn its text and <eos>; no generation prompt. A prompt of one user turn is thus
# the same ids as its text encoded with <bos> (what the GRPO prompts were before it), and an
# SFT row (runtime/sft/data.py) trains the answer and the <eos> that ends it.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ m['content'] }}{{ eos_token }}"
    "{%- else -%}{{ bos_token }}{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)


def build_tokenizer(characters: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: <pad>=0, <bos>=1, <eos>=2, then `characters` in order, then
    <unk>, which every other character encodes to (so any text encodes; the task's own text
    never holds one, and the ids before it are the same as without it).

    Encoding prepends <bos>; decoding with skip_special_tokens=True gives the plain text back.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    symbols = [PAD, BOS, EOS, *dict.fromkeys(characters), UNK]
    vocab = {s: i for i, s in enumerate(symbols)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # one piece per character, newlines too ("." would leave "\n\n" one piece)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    core.add_special_tokens([AddedToken(t, special=True) for t in (PAD, BOS, EOS, UNK)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
    )
