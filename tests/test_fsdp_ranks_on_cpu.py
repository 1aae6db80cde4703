"""FSDP2 across two trainer ranks (gloo, CPU): the same step, weights and resume as one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from runtime_helpers import join_group, run_ranks, token_batch

from recipes import architecture
from runtime.backends import OptimizerConfig, TitanTrainer
from runtime.grpo import policy_loss
from runtime.models import ModelSpec

SPEC = ModelSpec.from_arch(architecture("qwen3", "tiny"))
LOSS = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.1)


def _batch():
    # 7 rows: 4 + 3 per rank
    return token_batch(SPEC.vocab_size, rows=7, width=20, short=7)


def trainer(seed: int, tokens_per_micro_batch: int = 40, gather_once: bool = False) -> Any:
    """A CPU FSDP2 trainer rank of SPEC in fp32 (call after joining the group)."""
    from runtime.backends.fsdp_trainer import FSDPTrainer

    return FSDPTrainer(
        SPEC,
        OptimizerConfig(lr=1e-2),
        temperature=0.7,
        seed=seed,
        device="cpu",
        compute_dtype=torch.float32,
        publish_dtype=torch.float32,
        tokens_per_micro_batch=tokens_per_micro_batch,
        gather_once=gather_once,
    )


def _rank(rank: int, world: int, port: int, out: str) -> None:
    join_group(rank, world, port)
    import torch.distributed as dist

    tokens, mask, adv = _batch()
    first = trainer(1)
    sharded = type(next(iter(first.model.parameters()))).__name__
    old = first.logprobs(tokens, mask)
    stats = first.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    published = first.hf_state_dict()
    # DCP: each rank writes its own shards; read back below by one process (resharded)
    first.save_checkpoint(str(Path(out).parent / "dcp"))
    assert first.checkpoint_written(wait=True)
    # gathered a group at a time; only rank 0 keeps the published copy
    assert bool(published) == (rank == 0)
    # the flat layout without a gather: every rank, the names, shapes and dtypes published
    layout = first.hf_layout()
    assert all(t.device.type == "meta" for t in layout.values())
    if rank == 0:
        assert {k: (t.shape, t.dtype) for k, t in layout.items()} == {
            k: (t.shape, t.dtype) for k, t in published.items()
        }
    resumed = trainer(7)
    # As the runtime resumes: rank 0 writes the gathered state, every rank reads it back.
    state = first.state_dict()
    saved = Path(out).with_name("trainer.pt")
    if rank == 0:
        assert state["model"] and all(v is not None for v in state["model"].values())
        torch.save(state, saved)
    else:
        assert all(v is None for v in state["model"].values())  # no second copy on rank 1
    dist.barrier()
    resumed.load_state_dict(torch.load(saved, weights_only=False))
    again = [
        t.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS) for t in (first, resumed)
    ]
    if rank == 0:
        torch.save((sharded, stats, published, again), out)
    dist.destroy_process_group()


def test_two_ranks_train_like_one(tmp_path: Path):
    sharded, stats, published, (after, after_resume) = run_ranks(_rank, 2, tmp_path)
    assert sharded == "DTensor"

    tokens, mask, adv = _batch()
    one = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2), temperature=0.7, seed=1)
    old = one.logprobs(tokens, mask)
    expected = one.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    for key in ("loss", "kl", "response_tokens", "grad_norm", "ratio/mean"):
        assert abs(stats[key] - expected[key]) < 1e-5, key
    reference = one.hf_state_dict()
    assert published.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(published[name], tensor, rtol=0, atol=1e-4)
    # the restored ranks take the same second step as the ones that never stopped
    assert abs(after["loss"] - after_resume["loss"]) < 1e-6
    assert abs(after["grad_norm"] - after_resume["grad_norm"]) < 1e-5
    # the two ranks' DCP checkpoint resumes on one process: the same second step again
    files = [p.name for p in (tmp_path / "dcp" / "trainer").glob("*.distcp")]
    assert {f.split("_")[2] for f in files} == {"0", "1"}, files  # each rank its own
    single = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2), temperature=0.7, seed=99)
    single.load_checkpoint(str(tmp_path / "dcp"))
    assert single.step == 1
    # `old`: the initial policy's log-probs, what the ranks' second steps were given too
    again = single.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    for key in ("loss", "grad_norm"):
        assert abs(again[key] - after[key]) < 1e-5, key


def _prepared_rank(rank: int, world: int, port: int, out: str) -> None:
    """Two ranks: one trainer writes a DCP checkpoint after a step; another makes its host copy
    first (as a GPU trainer does at start-up), then resumes from that checkpoint."""
    join_group(rank, world, port)
    import torch.distributed as dist

    tokens, mask, adv = _batch()
    first = trainer(1)
    old = first.logprobs(tokens, mask)
    first.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    first.save_checkpoint(str(Path(out).parent / "dcp"))
    assert first.checkpoint_written(wait=True)
    resumed = trainer(7)
    resumed.logprobs(tokens, mask)  # a forward before the copy, as a publish makes one
    assert resumed.prepare_checkpoint_copy(on_cpu=True)
    resumed._saver.staged()
    cache = resumed._saver.stager._state_dict_stager._cached_storage_mapping
    made = sorted(host.data_ptr() for host in cache.values())
    resumed.load_checkpoint(str(Path(out).parent / "dcp"))
    again = [
        t.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS) for t in (first, resumed)
    ]
    refreshed = sorted(host.data_ptr() for host in cache.values())
    resumed.save_checkpoint(str(Path(out).parent / "dcp2"))
    assert resumed.checkpoint_written(wait=True)
    if rank == 0:
        torch.save((made, refreshed, again, resumed.step), out)
    dist.destroy_process_group()


def test_a_host_copy_made_before_a_resume_is_refreshed_in_place(tmp_path: Path):
    """FSDP2 ranks: the checkpoints' host copy made before the resume (a GPU trainer makes it
    at start-up) is refilled from the loaded state in the same host memory, and the resumed
    ranks take the step the writing ones take."""
    made, refreshed, (after, after_resume), step = run_ranks(_prepared_rank, 2, tmp_path)
    assert made and refreshed == made
    assert abs(after["loss"] - after_resume["loss"]) < 1e-6
    assert abs(after["grad_norm"] - after_resume["grad_norm"]) < 1e-5
    assert step == 2


def _uneven_rank(rank: int, world: int, port: int, out: str) -> None:
    """7 rows of width 20 at 60 tokens a micro-batch (3 rows): rank 0's 4 rows are two
    micro-batches, rank 1's 3 rows one. Both ranks must run as many forward and backward passes
    (FSDP2 gathers every block from all ranks in each), so rank 1 runs one more that counts
    zero times; the step is still the one-process step."""
    join_group(rank, world, port)
    import torch.distributed as dist

    tokens, mask, adv = _batch()
    ranked = trainer(1, tokens_per_micro_batch=60)
    old = ranked.logprobs(tokens, mask)
    stats = ranked.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    published = ranked.hf_state_dict()
    if rank == 0:
        torch.save((stats, published), out)
    dist.destroy_process_group()


def test_ranks_with_unequal_micro_batch_counts_take_the_one_process_step(tmp_path: Path):
    stats, published = run_ranks(_uneven_rank, 2, tmp_path)
    tokens, mask, adv = _batch()
    one = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2), temperature=0.7, seed=1)
    old = one.logprobs(tokens, mask)
    expected = one.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    for key in ("loss", "kl", "response_tokens", "grad_norm"):
        assert abs(stats[key] - expected[key]) < 1e-5, key
    for name, tensor in one.hf_state_dict().items():
        torch.testing.assert_close(published[name], tensor, rtol=0, atol=1e-4)


def _counting_collectives() -> dict[str, int]:
    """Counts FSDP2's all-gathers of a group's weights and reductions of its gradients (its
    own functions, wrapped in this process)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    counts = {"all_gather": 0, "reduce": 0}

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    group.foreach_all_gather = counted("all_gather", group.foreach_all_gather)
    group.foreach_reduce = counted("reduce", group.foreach_reduce)
    return counts


def _gather_once_rank(rank: int, world: int, port: int, out: str) -> None:
    """The uneven step (rank 1 runs a stand-in pass) twice on each trainer: reshard each pass,
    and gather once a step; the collectives each made, and what each step gave."""
    join_group(rank, world, port)
    import torch.distributed as dist

    counts = _counting_collectives()
    tokens, mask, adv = _batch()
    result = {}
    for gather in (False, True):
        ranked = trainer(1, tokens_per_micro_batch=60, gather_once=gather)
        groups = sum(1 for m in ranked.model.modules() if hasattr(m, "set_reshard_after_forward"))
        old = ranked.logprobs(tokens, mask)
        made = []
        stats = []
        for _ in range(2):
            before = dict(counts)
            stats.append(ranked.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS))
            made.append({k: counts[k] - before[k] for k in counts})
        lp = ranked.logprobs(tokens, mask)
        # the blocks hold their shards again after a forward (DTensor parameters)
        sharded = {type(p).__name__ for b in ranked.model.layers.values() for p in b.parameters()}
        result[gather] = (stats, made, groups, ranked.hf_state_dict(), lp, sharded)
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def test_gather_once_makes_one_all_gather_and_one_reduction_a_step_and_the_same_step(
    tmp_path: Path,
):
    """trainer.gather_once: two passes a rank (one of rank 1's a stand-in) share one all-gather
    and one gradient reduction of each FSDP group a step, where resharding each pass gathers
    every block again in its backward and in the next pass; the steps and weights are the
    same (fp32: the gradients summed in another order), and so are the log-probs of a forward
    after the steps, which leaves the blocks sharded as before."""
    result = run_ranks(_gather_once_rank, 2, tmp_path)
    (plain, plain_made, groups, plain_weights, plain_lp, plain_sharded) = result[False]
    (once, once_made, groups_once, once_weights, once_lp, once_sharded) = result[True]
    assert plain_sharded == once_sharded == {"DTensor"}
    assert groups == groups_once == SPEC.n_layers + 1  # each block and the root
    for made in once_made:
        assert made == {"all_gather": groups, "reduce": groups}, once_made
    for made in plain_made:
        assert made["reduce"] == 2 * groups and made["all_gather"] > 2 * groups, plain_made
    for a, b in zip(plain, once, strict=True):
        for key in ("loss", "kl", "response_tokens", "grad_norm"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    # after two AdamW steps at lr 1e-2 (the tolerance of the one-process comparisons above)
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(once_weights[name], tensor, rtol=0, atol=1e-4)
    torch.testing.assert_close(once_lp, plain_lp, rtol=0, atol=1e-4)
