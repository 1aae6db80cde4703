"""SFT data: the chat template applied, the loss on the assistant's tokens only (token by
token), bad data refused in one line, and packed rows computing what each row alone does."""

import json
from pathlib import Path

import pytest
import torch

from recipes import UserError, apply_overrides, load_recipe
from recipes.sft_rows import check_rows
from runtime.sft.data import (
    IGNORE,
    ChatEncoder,
    Counts,
    examples,
    micro_batches,
    pack,
    padded,
    token_losses,
)

# ChatML as Qwen3 writes it, an empty think block on an assistant turn after the last user turn
# (the case where a turn renders otherwise once turns follow it)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6"},
]


def tiny_tokenizer():
    from runtime.tasks.tiny import tokenizer

    return tokenizer()


def char_tokenizer(template=CHATML):
    from runtime.tasks.arith import tokenizer

    tok = tokenizer(None)
    tok.chat_template = template
    return tok


def test_the_tiny_template_trains_the_answer_and_its_eos_token_by_token():
    tok = tiny_tokenizer()
    ex = ChatEncoder(tok).encode(
        [{"role": "user", "content": "123"}, {"role": "assistant", "content": "321"}]
    )
    # <bos> 1 2 3 | 3 2 1 <eos>
    assert ex.ids == [1, 4, 5, 6, 6, 5, 4, 2]
    assert ex.trained == [False] * 4 + [True] * 4


def test_the_mask_of_a_multi_turn_chat_token_by_token():
    tok = char_tokenizer()
    ex = ChatEncoder(tok).encode(CHAT)
    pieces = [tok.decode([i]) for i in ex.ids]  # one token a character
    text = "".join(pieces)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n6<|im_end|>\n"
    )
    first = text.index("4<|im_end|>\n")
    last = text.index("<think>")
    expected = [first <= i < first + 12 or i >= last for i in range(len(text))]
    assert ex.trained == expected
    trained = "".join(p for p, t in zip(pieces, ex.trained, strict=True) if t)
    assert trained == "4<|im_end|>\n<think>\n\n</think>\n\n6<|im_end|>\n"


def test_grpo_prompts_of_the_tiny_task_are_the_ids_they_were_before_its_template():
    from runtime.backends.build import encode_messages
    from runtime.tasks.tiny import rows

    tok = tiny_tokenizer()
    for row in rows("train")[:20]:
        q = row["question"]
        with_template = encode_messages(tok, [{"role": "user", "content": q}], 16)
        assert with_template == tok(q, add_special_tokens=True)["input_ids"]


def test_a_tokenizer_without_a_chat_template_is_refused():
    with pytest.raises(UserError, match="model.tokenizer: the tokenizer has no chat template"):
        ChatEncoder(char_tokenizer(None), where="model.tokenizer")


def sft_dataset(*overrides):
    return apply_overrides(load_recipe("tiny-sft"), list(overrides)).dataset


def test_data_without_the_named_fields_names_them_and_its_own():
    rows = [{"conversation": CHAT, "id": 1}]
    with pytest.raises(
        UserError,
        match=r"dataset 'd.jsonl': dataset.messages_field 'messages' is not a field of the data "
        r"\(format messages\); its fields: conversation, id",
    ):
        check_rows(rows, sft_dataset(), "d.jsonl")
    pc = sft_dataset("dataset.format=prompt_completion", "dataset.completion_field=answer")
    with pytest.raises(UserError, match="dataset.completion_field 'answer' is not a field"):
        check_rows([{"prompt": "1", "completion": "2"}], pc, "d.jsonl")


def test_a_row_with_only_empty_assistant_turns_is_refused():
    rows = [{"messages": CHAT}, {"messages": [*CHAT[:2], {"role": "assistant", "content": " "}]}]
    with pytest.raises(UserError, match="row 1: no assistant turn with content"):
        check_rows(rows, sft_dataset(), "d.jsonl")


def test_prompt_completion_rows_are_a_user_turn_and_the_answer():
    ds = sft_dataset("dataset.format=prompt_completion")
    counts = Counts()
    [ex] = examples(
        [{"prompt": "12", "completion": "21"}], [0], ChatEncoder(tiny_tokenizer()), ds, counts
    )
    assert ex.ids == [1, 4, 5, 5, 4, 2] and ex.trained == [False] * 3 + [True] * 3


@pytest.mark.parametrize(("overlong", "kept", "truncated", "dropped"), [
    ("drop", 1, 0, 1), ("truncate", 2, 1, 0)
])  # fmt: skip
def test_rows_longer_than_max_tokens_are_cut_or_left_out_and_counted(
    overlong, kept, truncated, dropped
):
    ds = sft_dataset("dataset.max_tokens=8", f"dataset.overlong={overlong}")
    rows = [
        {"messages": [{"role": "user", "content": "12"}, {"role": "assistant", "content": "21"}]},
        {
            "messages": [
                {"role": "user", "content": "1234"},
                {"role": "assistant", "content": "432"},
            ]
        },
    ]
    counts = Counts()
    out = list(examples(rows, [0, 1], ChatEncoder(tiny_tokenizer()), ds, counts))
    assert len(out) == kept and all(len(e.ids) <= 8 for e in out)
    assert (counts.rows, counts.truncated, counts.dropped) == (2, truncated, dropped)


def shipped_examples(n=12):
    ds = load_recipe("tiny-sft").dataset
    rows = [json.loads(line) for line in Path(ds.path).read_text().splitlines()][:n]
    return list(examples(rows, range(n), ChatEncoder(tiny_tokenizer()), ds, Counts()))


def test_packing_keeps_to_the_budget_and_restarts_positions_at_each_row():
    exs = shipped_examples()
    packs = list(micro_batches(iter(exs), 40))
    assert sum(p.rows for p in packs) == len(exs) and len(packs) > 1
    for p in packs:
        assert p.tokens.shape == (1, 40)
        starts = (p.positions[0] == 0).nonzero().flatten().tolist()
        assert starts[: p.rows] == [sum(p.lengths[:i]) for i in range(p.rows)]
    assert sum(p.trained_tokens for p in packs) == sum(sum(e.trained[1:]) for e in exs)


def test_best_fit_packs_every_row_once_in_fewer_fuller_micro_batches():
    """Best-fit decreasing (`sft.packing: best_fit`, the default): every row exactly once, no
    micro-batch over the budget, never more micro-batches than packing in order, here fewer;
    the same rows in another order give micro-batches of the same lengths."""
    import random

    from runtime.sft.data import best_fit

    exs = shipped_examples(40)
    budget = 2 * max(len(e.ids) for e in exs)
    fitted = best_fit(exs, budget)
    in_order = list(micro_batches(iter(exs), budget, pad_to=False))
    assert sorted(id(e) for b in fitted for e in b) == sorted(id(e) for e in exs)
    assert all(sum(len(e.ids) for e in b) <= budget for b in fitted)
    assert len(fitted) < len(in_order)
    # a rows' permutation changes nothing but the order of equal-length ties
    shuffled = exs[:]
    random.Random(0).shuffle(shuffled)
    as_lengths = lambda bins: sorted(sorted(len(e.ids) for e in b) for b in bins)  # noqa: E731
    assert as_lengths(best_fit(shuffled, budget)) == as_lengths(fitted)
    packed = list(micro_batches(iter(exs), budget, pad_to=False, packing="best_fit"))
    assert [p.rows for p in packed] == [len(b) for b in fitted]
    assert sum(p.trained_tokens for p in packed) == sum(p.trained_tokens for p in in_order)
    # a row over the budget gets a micro-batch of its own
    assert [len(b) for b in best_fit(exs[:3], 1)] == [1, 1, 1]


def test_a_steps_rows_are_packed_as_the_recipe_says():
    """The run takes a step's rows and packs them (runtime.sft.run.Ahead) with `sft.packing`:
    the same rows either way, best fit in no more micro-batches than in order."""
    from runtime.sft.run import Ahead, RowStream

    recipe = load_recipe("tiny-sft")
    ds = recipe.dataset
    rows = [json.loads(line) for line in Path(ds.path).read_text().splitlines()]
    taken = {}
    for packing in ("in_order", "best_fit"):
        stream = RowStream(rows, ChatEncoder(tiny_tokenizer()), ds, seed=0)
        ahead = Ahead(stream, 2048, 128, packing)
        try:
            taken[packing] = ahead.get()
        finally:
            ahead.close()
    first, fitted = taken["in_order"], taken["best_fit"]
    assert [e.ids for e in first.rows] == [e.ids for e in fitted.rows]
    assert sum(p.rows for p in fitted.packs) == len(fitted.rows)
    assert len(fitted.packs) <= len(first.packs)
    assert [p.lengths for p in fitted.packs] != [p.lengths for p in first.packs]


def test_a_step_split_over_ranks_pads_its_last_micro_batch_to_the_one_beside_it():
    """On several ranks the leftover micro-batch (the packing's last, short) is padded to the
    longest micro-batch of its round, trained nowhere in its padding; every rank runs as many;
    one rank runs them as packed."""
    from runtime.sft.train import rank_share

    exs = shipped_examples()
    packs = [pack(exs[:5]), pack(exs[5:9]), pack(exs[9:10])]
    widths = [p.tokens.shape[1] for p in packs]
    assert widths[2] < min(widths[:2]) and widths[0] != widths[1]
    assert rank_share(packs, 0, 1) == packs
    mine = [rank_share(packs, r, 2) for r in range(2)]
    assert [len(m) for m in mine] == [2, 2]
    assert mine[0][0] is packs[0] and mine[1][0] is packs[1]
    last, fill = mine[0][1], mine[1][1]  # the last round: packs[2] beside a copy of packs[0]
    assert last.tokens.shape == (1, widths[0]) and not last.filler
    assert fill.filler and fill.trained_tokens == 0 and fill.tokens.shape == (1, widths[0])
    assert torch.equal(last.tokens[:, : widths[2]], packs[2].tokens)
    assert torch.equal(last.targets[:, : widths[2]], packs[2].targets)
    assert last.trained_tokens == packs[2].trained_tokens and last.rows == packs[2].rows
    assert last.positions[0, widths[2]] == 0  # the padding is a row of its own
    assert int(last.positions[0, widths[2] :].max()) < max(packs[2].lengths)  # model's context
    three = [rank_share(packs, r, 3) for r in range(3)]  # one round of all three
    assert [m[0].tokens.shape[1] for m in three] == [*widths[:2], max(widths[:2])]
    assert padded(packs[0], widths[0] - 1) is packs[0]


def test_packed_rows_give_each_rows_own_logits_and_loss():
    """Rows end to end under the document mask (the CPU's packed attention) give the logits and
    the summed loss of each row alone under plain causal attention."""
    from recipes import architecture
    from runtime.models.packing import attention_masks
    from runtime.models.spec import ModelSpec
    from runtime.models.titan import build_model

    spec = ModelSpec.from_arch(architecture("qwen3", "tiny"), family="qwen3")
    packed_model = build_model(spec, attention="document", seed=3)
    plain = build_model(spec, attention="sdpa", seed=3)
    exs = shipped_examples(4)
    p = pack(exs, length=sum(len(e.ids) for e in exs) + 5)
    logits = packed_model(
        p.tokens, p.positions, attention_masks(packed_model, p.positions, "document")
    )
    packed_loss = token_losses(logits, p.targets)
    packed_loss.backward()
    alone_loss, at = 0.0, 0
    for ex in exs:
        one = pack([ex])
        row_logits = plain(one.tokens)
        assert torch.allclose(logits[:, at : at + len(ex.ids)], row_logits, atol=1e-5)
        alone_loss += float(token_losses(row_logits, one.targets).detach())
        at += len(ex.ids)
    assert float(packed_loss) == pytest.approx(alone_loss, rel=1e-5)
    assert (p.targets[0, at:] == IGNORE).all()  # the filler trains nothing
    grads = [q.grad for q in packed_model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.slow
def test_flex_attention_keeps_packed_rows_apart_on_the_cpu_forward():
    """TorchTitan's flex attention with the mask its decoder builds from the positions, the
    trainer's `attention="flex"` (compiled; forward only: torch has no flex backward on the CPU).
    Not SFT's GPU path yet: on the nodes' torch 2.11 its block mask fails (docs/sft.md)."""
    from recipes import architecture
    from runtime.models.packing import attention_masks
    from runtime.models.spec import ModelSpec
    from runtime.models.titan import build_model

    spec = ModelSpec.from_arch(architecture("qwen3", "tiny"), family="qwen3")
    flex = build_model(spec, attention="flex", seed=3)
    plain = build_model(spec, attention="sdpa", seed=3)
    exs = shipped_examples(3)
    p = pack(exs)
    with torch.no_grad():
        logits = flex(p.tokens, p.positions, attention_masks(flex, p.positions, "flex"))
        at = 0
        for ex in exs:
            row = plain(pack([ex]).tokens)
            assert torch.allclose(logits[:, at : at + len(ex.ids)], row, atol=1e-5)
            at += len(ex.ids)
