"""The tiny task's tokenizer: one token per character, built locally (no download)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


def build_tokenizer(characters: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: <pad>=0, <bos>=1, <eos>=2, then `characters` in order.

    Encoding prepends <bos>; decoding with skip_special_tokens=True gives the plain text back.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    symbols = [PAD, BOS, EOS, *dict.fromkeys(characters)]
    vocab = {s: i for i, s in enumerate(symbols)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
