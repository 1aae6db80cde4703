"""A character tokenizer sized to a model's vocabulary, built locally (no download)."""

from __future__ import annotations

import string

from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARACTERS = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")


def build_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """<pad>=0, <bos>=1, <eos>=2, one id per character of `CHARACTERS`, then `<unused_N>` filler
    up to `vocab_size`. Encoding prepends <bos>; decoding drops the filler, and the specials with
    skip_special_tokens=True."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    symbols = [PAD, BOS, EOS, *CHARACTERS]
    size = len(symbols) if vocab_size is None else vocab_size
    if size < len(symbols):
        raise ValueError(f"vocab_size {size} is below the {len(symbols)} characters and specials")
    filler = [f"<unused_{i}>" for i in range(size - len(symbols))]
    vocab = {s: i for i, s in enumerate([*symbols, *filler])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # one piece per character, newlines too ("." would leave "\n\n" as one unknown piece)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Filler decodes to nothing (a random-weight model samples mostly filler).
    core.decoder = decoders.Sequence(
        [decoders.Replace(Regex(r"<unused_\d+>"), ""), decoders.Fuse()]
    )
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    core.add_special_tokens([AddedToken(t, special=True) for t in (PAD, BOS, EOS)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
