"""Real weights into sharded models: built on meta, each rank allocates and fills only its shards
from a Hugging Face folder read one block at a time (two gloo ranks on CPU, FSDP2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from runtime_helpers import join_group, run_ranks, token_batch
from test_models import LLAMA, QWEN

from recipes import UserError
from runtime.backends import OptimizerConfig, TitanTrainer
from runtime.models import build_hf_model, load_pretrained
from runtime.models.loading import GivenWeights, HFWeights, load_into, weight_source
from runtime.models.titan import materialize, meta_model

SPECS = {
    "qwen3-tied": QWEN,
    "llama3-untied": dataclasses.replace(LLAMA, tie_embeddings=False),
}


def save_hf(spec, folder: Path) -> Path:
    """An HF checkpoint of `spec` as transformers saves it, split over several files."""
    torch.manual_seed(0)
    build_hf_model(spec).save_pretrained(folder, safe_serialization=True, max_shard_size="200KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    return folder


def _rank(rank: int, world: int, port: int, out: str) -> None:
    join_group(rank, world, port)
    import torch.distributed as dist

    from runtime.backends.fsdp_trainer import FSDPTrainer

    folder = Path(out).parent
    results = {}
    for name, spec in SPECS.items():
        trainer = FSDPTrainer(
            spec,
            OptimizerConfig(lr=1e-2),
            weights=weight_source(str(folder / name), spec),
            device="cpu",
            compute_dtype=torch.float32,
            publish_dtype=torch.float32,
        )
        local = {n: p.to_local().clone() for n, p in trainer.model.named_parameters()}
        tokens, mask, _ = token_batch(spec.vocab_size, rows=3, width=16)
        results[name] = {
            "local": local,
            "logprobs": trainer.logprobs(tokens, mask),
            "published": trainer.hf_state_dict(),
        }
    gathered = [None] * world
    dist.all_gather_object(gathered, {n: r["local"] for n, r in results.items()})
    if rank == 0:
        torch.save({"ranks": gathered, "results": results}, out)
    dist.destroy_process_group()


def test_two_ranks_load_their_shards_of_an_hf_checkpoint(tmp_path: Path):
    for name, spec in SPECS.items():
        save_hf(spec, tmp_path / name)
    saved = run_ranks(_rank, 2, tmp_path)
    for name, spec in SPECS.items():
        full = load_pretrained(str(tmp_path / name), spec)
        one = TitanTrainer(spec, OptimizerConfig(lr=1e-2), weights=full)
        expected = dict(one.model.named_parameters())
        for param, value in expected.items():
            shards = [ranks[name][param] for ranks in saved["ranks"]]
            # each rank holds its half (dim 0), and the halves make the checkpoint's tensor
            assert shards[0].shape[0] == -(-value.shape[0] // 2), param
            torch.testing.assert_close(torch.cat(shards), value.detach(), rtol=0, atol=0)
        result = saved["results"][name]
        tokens, mask, _ = token_batch(spec.vocab_size, rows=3, width=16)
        torch.testing.assert_close(
            result["logprobs"], one.logprobs(tokens, mask), atol=1e-5, rtol=0
        )
        # published under HF names, equal to the file it was loaded from
        hf = {k: v for k, v in one.hf_state_dict().items()}
        assert result["published"].keys() == hf.keys()
        for key, value in hf.items():
            torch.testing.assert_close(result["published"][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_checkpoint_is_read_one_block_at_a_time(tmp_path: Path, name: str):
    spec = SPECS[name]
    source = weight_source(str(save_hf(spec, tmp_path)), spec)
    assert isinstance(source, HFWeights)
    groups = list(source.groups())
    # the tensors outside the blocks first, then one group per block
    assert len(groups) == spec.n_layers + 1
    assert not any(".layers." in k or k.startswith("layers.") for k in groups[0])
    for index, group in enumerate(groups[1:]):
        assert {k.split(".")[1] for k in group} == {str(index)}
    assert {k: v.shape for g in groups for k, v in g.items()} == {
        k: v.shape for k, v in load_pretrained(str(tmp_path), spec).items()
    }


def test_weights_that_do_not_fit_are_one_clear_error():
    spec = SPECS["llama3-untied"]
    model = materialize(meta_model(spec), "cpu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    wrong = dict(state, **{"norm.weight": torch.ones(spec.dim + 1)})
    with pytest.raises(UserError, match=r"norm.weight has shape \(65,\), the model \(64,\)"):
        load_into(materialize(meta_model(spec), "cpu"), GivenWeights(wrong))
    missing = {k: v for k, v in state.items() if k != "norm.weight"}
    with pytest.raises(UserError, match="1 parameter"):
        load_into(materialize(meta_model(spec), "cpu"), GivenWeights(missing))
    extra = dict(state, **{"layers.0.bogus.weight": torch.ones(2)})
    with pytest.raises(UserError, match="bogus.weight is not a parameter"):
        load_into(materialize(meta_model(spec), "cpu"), GivenWeights(extra))


def _reference_rank(rank: int, world: int, port: int, out: str) -> None:
    join_group(rank, world, port)
    import torch.distributed as dist

    from runtime.backends.fsdp_reference import GPUReference

    spec = SPECS["qwen3-tied"]
    folder = Path(out).parent / "qwen3-tied"
    ref = GPUReference(
        spec,
        temperature=0.7,
        weights=weight_source(str(folder), spec),
        device="cpu",
        dtype=torch.float32,
        tokens_per_micro_batch=16,  # one row a forward: 5 rows are 3 forwards and 2
    )
    sharded = type(next(ref.model.parameters())).__name__
    scored = {}
    for rows in (5, 1):  # with 1 row, rank 1 has none and only joins the collectives
        tokens, mask, _ = token_batch(spec.vocab_size, rows=rows, width=16)
        share = ref.my_rows(rows)
        scored[rows] = (share.start, ref.logprobs(tokens, mask))
    # after scoring too: FSDP2 would keep the root's weights gathered for a backward
    after = sorted({type(p).__name__ for p in ref.model.parameters()})
    answers = [None] * world
    dist.all_gather_object(answers, (sharded, scored, after))
    if rank == 0:
        torch.save(answers, out)
    dist.destroy_process_group()


def test_a_reference_sharded_over_two_ranks_scores_its_rows_like_one_process(tmp_path: Path):
    from runtime.backends.fsdp_reference import GPUReference

    spec = SPECS["qwen3-tied"]
    save_hf(spec, tmp_path / "qwen3-tied")
    answers = run_ranks(_reference_rank, 2, tmp_path)
    assert [a[0] for a in answers] == ["DTensor", "DTensor"]
    assert [a[2] for a in answers] == [["DTensor"], ["DTensor"]]  # every weight still a shard
    one = GPUReference(
        spec,
        temperature=0.7,
        weights=weight_source(str(tmp_path / "qwen3-tied"), spec),
        device="cpu",
        dtype=torch.float32,
    )
    for rows in (5, 1):
        tokens, mask, _ = token_batch(spec.vocab_size, rows=rows, width=16)
        shares = sorted((a[1][rows][0], a[1][rows][1]) for a in answers)
        got = torch.cat([lp for _, lp in shares])
        assert got.shape == tokens.shape
        torch.testing.assert_close(got, one.logprobs(tokens, mask), atol=1e-5, rtol=0)
