"""GPU trainer: TorchTitan models in bf16 compute, FSDP2 across trainer ranks.

Precision. The trainer keeps fp32 master weights and AdamW state and computes in bf16:
- one rank (the common layout: one trainer GPU): bf16 autocast around the forward; weights are
  cast per matmul (a few ms per step for 1.7B), gradients land in fp32;
- several ranks: FSDP2 `fully_shard` per transformer block and at the root, with
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.
The reference (runtime.backends.fsdp_reference) holds bf16 weights (sharded over its GPUs when
it has several) and scores under `no_grad` with this module's forward.

Memory. Only response positions need log-probs, so the decoder runs without its output
projection (`_skip_lm_head`), the hidden states of the positions that predict response tokens
are gathered, and the projection plus log-softmax run on those alone: `[N_response, vocab]`
logits instead of `[B, T, vocab]`; compiled, the projection's log-softmax is one reduction over
its bf16 output (`head_logprobs`). Batches are split into micro-batches of about
`tokens_per_micro_batch` tokens (gradients accumulate), which bounds activations and logits.
Activation checkpointing recomputes each block's forward in backward (about a third more FLOPs,
for a GPU too small to hold every block's activations); recipes/settings.py plans the
micro-batch and whether to checkpoint for a GPU's size (recipes.memory.trainer_memory_plan).

Compile (optional): each block's forward goes through `torch.compile(dynamic=True)`, outside the
checkpoint so that the compiler sees the recomputed region, and so does the output projection
with its log-softmax; sequence lengths vary with every batch, and dynamic shapes keep a new
width from compiling again.

LoRA (`lora`, a recipe's model.lora): the decoder as TorchTitan's LoRA converts it
(runtime.models.lora). The frozen base's projections are stored in the compute dtype (they never
change: no fp32 master copy), the adapter in fp32; the optimizer, gradient clipping and
checkpoints cover the adapter alone, a published version is the adapter under PEFT's names, and
`reference_logprobs` scores the base (the adapter off) in the trainer's own processes.

Attention: the SDPA override of `runtime.models.titan` (causal, right padding is exact), which
on CUDA picks PyTorch's own cuDNN or flash kernels for bf16; no flash-attn package is needed.

Several ranks: this backend shards over the default process group when one with more than one
rank is configured (`init_distributed`); every rank gets the same `train_step` call and trains on
its share of the batch. The runtime spawns one trainer proc per trainer GPU and calls every
endpoint on all of them (`runtime.actors.trainer`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.backends import trainer_state
from runtime.backends.base import LossFn, finite_grad_norm, loss_inputs
from runtime.backends.blocks import micro_batches, wrap_blocks
from runtime.backends.gpu_memory import PeakMemory
from runtime.backends.scoring import (
    passes_missing,
    rank_rows,
    response_logprobs,
    score_rows,
    stand_in,
)
from runtime.backends.titan_trainer import OptimizerConfig
from runtime.models import ModelSpec, to_hf
from runtime.models.loading import WeightSource, as_source, load_into
from runtime.models.lora import AdapterParameters, adapter_off, adapter_state, peft_state
from runtime.models.titan import materialize, meta_model
from runtime.weights.flat import cast_together

# Stats that add up across micro-batches and ranks; the rest are averaged weighted by tokens.
_SUMMED = ("loss", "pg_loss", "response_tokens")  # runtime.grpo.SUMMED_STATS


WORLD_ENV = "FORGESKY_TRAINER_WORLD_SIZE"
RANK_ENV = "FORGESKY_PROC_RANK"  # runtime.procs.mesh sets it in every proc


def init_distributed() -> int:
    """Join the trainer's process group when `FORGESKY_TRAINER_WORLD_SIZE` > 1; the world size.

    Rank from `FORGESKY_PROC_RANK`, rendezvous at `MASTER_ADDR`:`MASTER_PORT` (env://).
    """
    world = int(os.environ.get(WORLD_ENV, "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            rank=int(os.environ[RANK_ENV]),
            world_size=world,
        )
    return world if world > 1 else 1


def _full(tensor: Tensor) -> Tensor:
    """The whole tensor of a (possibly sharded) parameter. On a mesh of one rank the local shard
    is already whole: no collective (hundreds of adapter matrices each publish)."""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    if tensor.device_mesh.size() == 1:
        local = tensor.to_local()
        if local.shape == tensor.shape:
            return local
    return tensor.full_tensor()


class FSDPTrainer(trainer_state.Checkpointing):
    """The policy on GPU(s); the same interface as `TitanTrainer` (see `TrainerBackend`).

    `publish_dtype` is the dtype of `hf_state_dict()` (what generators load; bf16 halves the
    bytes to move). `activation_checkpointing` recomputes each block in backward; `compile`
    runs each block through torch.compile (see `wrap_blocks`). `gather_once` (several ranks):
    a step's micro-batches share one all-gather of the weights and one reduce-scatter of the
    gradients (`_passes`). Works on CPU too (no autocast), which is how its math is tested
    without a GPU.
    """

    def __init__(
        self,
        spec: ModelSpec,
        optim: OptimizerConfig,
        *,
        temperature: float = 1.0,
        weights: WeightSource | Mapping[str, Tensor] | None = None,
        seed: int = 0,
        device: str | torch.device = "cuda",
        compute_dtype: torch.dtype = torch.bfloat16,
        publish_dtype: torch.dtype = torch.bfloat16,
        tokens_per_micro_batch: int = 8192,
        activation_checkpointing: bool = True,
        compile: bool = False,
        compile_head: bool = True,
        gather_once: bool = False,
        lora: Any = None,
        attention: str = "sdpa",
    ):
        self.spec = spec
        self.attention = attention  # SFT's packed rows: "varlen", "document" or "flex" (packing.py)
        self.lora = lora
        self._adapter: AdapterParameters | None = None  # where the adapter's parameters sit
        self.optim_config = optim
        self.temperature = temperature
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.publish_dtype = publish_dtype
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.activation_checkpointing = activation_checkpointing
        self.world = init_distributed()
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.gather_once = gather_once and self.world > 1
        # Built on meta, sharded there, then only this rank's shards get storage and are filled
        # from the source a block at a time: no rank ever holds the whole model.
        self.model = meta_model(spec, attention, lora=lora)
        if lora is not None and compute_dtype != torch.float32:
            _round_frozen_weights(self.model, compute_dtype)
        self.model._skip_lm_head = True
        self.compiled = compile
        wrap_blocks(
            self.model,
            checkpointing=activation_checkpointing,
            compile=compile,
            compile_head=compile_head,
        )
        if self.world > 1:
            self._shard()
        materialize(self.model, self.device)
        load_into(self.model, as_source(weights, spec, seed, lora), "the trainer")
        self.model.train()
        self.optimizer, self.scheduler = optim.build(self.model, fused=self.device.type == "cuda")
        self.step = 0
        # GPU peaks by phase (start-up until here, then steps, publishes, checkpoint writes)
        self.memory = PeakMemory(self.device)
        self.memory.record("startup")

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        # Root unit: embeddings, final norm and output projection (tied weights stay together).
        fully_shard(self.model, mesh=mesh, mp_policy=policy)

    @contextlib.contextmanager
    def _passes(self, count: int) -> Iterator[Callable[[int], None]]:
        """A train step's `count` forward-backward passes (every rank the same count): call what
        it gives with each pass's index before that pass. With `gather_once`, FSDP keeps the
        weights gathered and the gradients unreduced (accumulated unsharded, in fp32) between
        the passes, and the last pass's backward reduces them all and reshards: one all-gather
        and one reduce-scatter a step, where each pass would otherwise make its own. Leaving
        it, however the step ends, sets FSDP back to resharding after every pass. Without
        `gather_once`, nothing changes."""
        if not self.gather_once or count < 2:
            yield lambda i: None
            return
        model = self.model

        def before(i: int) -> None:
            if i == count - 1:  # the last pass's backward reduces and reshards
                model.set_reshard_after_backward(True)
                model.set_requires_gradient_sync(True)

        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
        try:
            yield before
        finally:
            model.set_reshard_after_backward(True)
            model.set_requires_gradient_sync(True)
            # the blocks reshard after a forward again; the root keeps its weights after its
            # forward, as fully_shard leaves it
            model.set_reshard_after_forward(True)
            model.set_reshard_after_forward(False, recurse=False)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.world == 1 and self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def _forward(self, tokens: Tensor, response_mask: Tensor, entropy: int = 0) -> Any:
        with self._autocast():
            return response_logprobs(
                self.model,
                tokens.to(self.device),
                response_mask.to(self.device),
                self.temperature,
                entropy,
            )

    def warm_up(self, width: int, entropy: int) -> dict[str, float] | None:
        """Make a compiled trainer's graphs before its first step (runtime.backends.warm_up):
        one micro-batch of made-up rows `width` tokens wide through the step's passes, the
        reference's first under LoRA (the base, adapter off, without gradients), then the
        training pass with `entropy` as the step computes it (`loss_inputs`: 1 a metric, 2 with
        its graph). Nothing stays: no optimizer step, the gradients dropped, the run's random
        generators untouched. Every rank must call it. None where nothing compiles.

        One rank alone on a GPU it shares with a generator that is still starting may find no
        room: then the warm-up is given up (`out_of_memory`) and the first step compiles, as
        without it. Several ranks do not try that (a rank that stopped early would leave the
        others in a collective)."""
        from runtime.backends.warm_up import compile_ahead, synthetic_rows

        if not self.compiled:
            return None
        tokens, mask = synthetic_rows(self.spec.vocab_size, width, self.tokens_per_micro_batch)

        def passes() -> None:
            if self.lora is not None:
                # every rank scores its share of the rows: the micro-batch on each
                self.reference_logprobs(tokens.repeat(self.world, 1), mask.repeat(self.world, 1))
            lp, ent = self._forward(tokens, mask, entropy)
            (lp.sum() * 0.0 + (0.0 if ent is None else ent.sum() * 0.0)).backward()
            self.optimizer.zero_grad(set_to_none=True)

        with self.memory.phase("warm_up"):
            if self.world > 1:
                return compile_ahead(passes, self.device)
            try:
                return compile_ahead(passes, self.device)
            except torch.OutOfMemoryError:
                self.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                return {"graphs": 0.0, "seconds": 0.0, "out_of_memory": 1.0}

    def logprobs(self, tokens: Tensor, response_mask: Tensor) -> Tensor:
        """Teacher-forced log-probs `[B, T]` of the current policy (0 off the response)."""
        with torch.no_grad():
            parts = micro_batches(tokens, self.tokens_per_micro_batch)
            out = torch.cat([self._forward(tokens[p], response_mask[p]) for p in parts])
        if self.world > 1:
            # FSDP2 leaves the root's weights gathered after a forward without a backward: the
            # memory of all of them, and parameters the optimizer does not hold (a checkpoint
            # of the optimizer's state then fails to name them)
            self.model.reshard()
        return out

    def my_rows(self, batch: int) -> slice:
        """This rank's share of a batch's rows (what it trains on, and scores as the reference)."""
        return rank_rows(batch, self.rank, self.world)

    def reference_logprobs(self, tokens: Tensor, response_mask: Tensor) -> Tensor:
        """A LoRA run's reference: the base's log-probs (the adapter off) `[rows, T]` of this
        rank's rows (`my_rows`), in the policy's precision. Every rank must call it."""
        if self.lora is None:
            raise RuntimeError("reference_logprobs: a full-parameter trainer has no base to score")
        rows = self.my_rows(tokens.shape[0])
        with adapter_off(self.model):
            return score_rows(
                self.model,
                tokens[rows],
                response_mask[rows],
                temperature=self.temperature,
                tokens_per_micro_batch=self.tokens_per_micro_batch,
                device=self.device,
                world=self.world,
                precision=self._autocast(),
            )

    def train_step(
        self,
        tokens: Tensor,
        response_mask: Tensor,
        advantages: Tensor,
        old_logprobs: Tensor | None,
        ref_logprobs: Tensor | None,
        loss_fn: LossFn,
        **loss_kwargs: Any,
    ) -> dict[str, float]:
        """One AdamW step on the whole batch (micro-batches accumulate; ranks split the rows)."""
        with self.memory.phase("train"):
            return self._train_step(
                tokens,
                response_mask,
                advantages,
                old_logprobs,
                ref_logprobs,
                loss_fn,
                **loss_kwargs,
            )

    def _train_step(
        self,
        tokens: Tensor,
        response_mask: Tensor,
        advantages: Tensor,
        old_logprobs: Tensor | None,
        ref_logprobs: Tensor | None,
        loss_fn: LossFn,
        **loss_kwargs: Any,
    ) -> dict[str, float]:
        batch = tokens.shape[0]
        rows = self.my_rows(batch)
        loss_kwargs, loss_mask, entropy = loss_inputs(loss_kwargs, response_mask)
        # FSDP averages gradients over ranks; each rank's loss is its share of the batch's sum.
        scale = float(self.world)
        self.optimizer.zero_grad(set_to_none=True)
        summed: dict[str, float] = {}
        weighted: dict[str, float] = {}
        token_total = 0.0
        local = tokens[rows]
        parts = micro_batches(local, self.tokens_per_micro_batch)
        # ranks whose shares split into fewer micro-batches run passes that count zero times
        missing = passes_missing(len(parts), self.world, self.device)
        own = [slice(rows.start + p.start, rows.start + p.stop) for p in parts]
        with self._passes(len(parts) + missing) as before:
            for i, part in enumerate(parts):
                before(i)
                sel = slice(rows.start + part.start, rows.start + part.stop)
                mask = response_mask[sel].to(self.device)
                lp, ent = self._forward(tokens[sel], mask, entropy)
                loss, stats = loss_fn(
                    lp,
                    None if old_logprobs is None else old_logprobs[sel].to(self.device),
                    None if ref_logprobs is None else ref_logprobs[sel].to(self.device),
                    advantages[sel].to(self.device),
                    mask,
                    entropy=ent,
                    loss_mask=None if loss_mask is None else loss_mask[sel].to(self.device),
                    **loss_kwargs,
                )
                (loss * scale if scale != 1.0 else loss).backward()
                w = float(stats.get("response_tokens", mask.sum()))
                token_total += w
                for key, value in stats.items():
                    if key in _SUMMED:
                        summed[key] = summed.get(key, 0.0) + value
                    else:
                        weighted[key] = weighted.get(key, 0.0) + value * w
            for i in range(len(parts), len(parts) + missing):
                before(i)
                stand = stand_in(tokens, response_mask, own, self.device)
                lp, ent = self._forward(*stand, entropy)
                (lp.sum() * 0.0 + (0.0 if ent is None else ent.sum() * 0.0)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            trainer_state.trained(self.model).values(), self.optim_config.max_grad_norm
        )
        # every rank has the same total norm: all of them stop here, none waits in a collective
        norm = finite_grad_norm(_full(grad_norm), self.step + 1)
        lr = self.optimizer.param_groups[0]["lr"]
        staging = self.checkpoint_staged()  # a checkpoint's copy of the state, if one is going
        self.optimizer.step()
        # Gradients are not needed past the update: freeing them now keeps 4 bytes a parameter
        # (of this rank's shards) out of the publish, the checkpoint copy and, with the services
        # colocated, the generator's and reference's turns.
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        totals = self._reduce(summed, weighted, token_total)
        totals.update(grad_norm=norm, lr=lr, step=float(self.step))
        return totals | staging

    def sft_step(self, packs: Sequence[Any]) -> dict[str, float]:
        """One AdamW step of SFT on the step's packed micro-batches (runtime.sft.data.Packed),
        every rank given all of them: rank r takes micro-batches r, r + world, ... (a filler
        where it has fewer than another; runtime.sft.train.rank_share). The loss is the summed
        cross-entropy of the trained tokens over the step's count of them on every rank. Every
        rank must call it."""
        from runtime.sft.train import packed_loss, rank_share

        with self.memory.phase("train"):
            mine = rank_share(packs, self.rank, self.world)
            total = sum(p.trained_tokens for p in packs) or 1
            # FSDP averages gradients over ranks; each rank's loss is its share of the sum
            scale = float(self.world) / total
            self.optimizer.zero_grad(set_to_none=True)
            summed = 0.0
            with self._passes(len(mine)) as before:
                for i, p in enumerate(mine):
                    before(i)
                    with self._autocast():
                        loss = packed_loss(self.model, p, self.attention, self.device)
                    (loss * scale).backward()
                    summed += float(loss.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(
                trainer_state.trained(self.model).values(), self.optim_config.max_grad_norm
            )
            norm = finite_grad_norm(_full(grad_norm), self.step + 1)
            lr = self.optimizer.param_groups[0]["lr"]
            staging = self.checkpoint_staged()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            totals = self._reduce({"loss": summed}, {}, 0.0)
            loss = totals["loss"] / total
            return {"loss": loss, "grad_norm": norm, "lr": lr, "step": float(self.step)} | staging

    def sft_loss(self, packs: Sequence[Any]) -> tuple[float, int]:
        """The summed cross-entropy of the trained tokens of `packs` and their count (no step),
        every rank given all of them and scoring its share as `sft_step` does; every rank
        answers the whole sum. Every rank must call it."""
        from runtime.sft.train import packed_loss, rank_share

        if not packs:
            return 0.0, 0
        mine = rank_share(packs, self.rank, self.world)
        summed = 0.0
        with torch.no_grad():
            for p in mine:
                with self._autocast():
                    summed += float(packed_loss(self.model, p, self.attention, self.device))
        if self.world > 1:
            self.model.reshard()  # the root's weights stay gathered otherwise (see `logprobs`)
        total = self._reduce({"loss": summed}, {}, 0.0)["loss"]
        return total, sum(p.trained_tokens for p in packs)

    def _reduce(
        self, summed: dict[str, float], weighted: dict[str, float], tokens: float
    ) -> dict[str, float]:
        keys = sorted(summed), sorted(weighted)
        values = [summed[k] for k in keys[0]] + [weighted[k] for k in keys[1]] + [tokens]
        if self.world > 1:
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            values = t.tolist()
        out = dict(zip(keys[0], values[: len(keys[0])], strict=True))
        total = values[-1] or 1.0
        for k, v in zip(keys[1], values[len(keys[0]) : -1], strict=True):
            out[k] = v / total
        return out

    def hf_groups(self) -> Iterator[dict[str, Tensor]]:
        """The current weights under HF names in `publish_dtype`, a group at a time: the tensors
        outside the blocks, then each block. With several ranks each group is gathered (a
        collective: every rank must iterate) and only rank 0 keeps it; the other ranks get
        empty groups and never hold more than one gathered block."""
        keep = self.rank == 0
        with torch.no_grad():
            if self.lora is not None:  # the adapter alone, under PEFT's names
                if self._adapter is None:  # built at the first publish, once wrapped
                    self._adapter = AdapterParameters(self.model)
                adapter = {k: _full(v).detach() for k, v in self._adapter().items()}
                yield self._peft(adapter, self.publish_dtype) if keep else {}
                return
            for prefix, module in self._groups():
                part = module.state_dict(prefix=prefix)  # fused q/k/v split as checkpoints name it
                full = {k: _full(v).detach().to(self.publish_dtype) for k, v in part.items()}
                yield to_hf(full, self.spec) if keep else {}
                del part, full

    def hf_layout(self) -> dict[str, Tensor]:
        """What `hf_groups` yields, as meta tensors (names, shapes, `publish_dtype`): the flat
        layout of a version without gathering or allocating anything (every rank alike)."""
        if self.lora is not None:
            return self._peft(adapter_state(self.model), self.publish_dtype, meta=True)
        out: dict[str, Tensor] = {}
        for prefix, module in self._groups():
            part = module.state_dict(prefix=prefix)
            meta = {
                k: torch.empty(v.shape, dtype=self.publish_dtype, device="meta")
                for k, v in part.items()
            }
            out.update(to_hf(meta, self.spec))
        return out

    def _peft(self, adapter: dict[str, Tensor], dtype: torch.dtype, meta: bool = False) -> Any:
        if meta:
            adapter = {k: torch.empty(v.shape, device="meta") for k, v in adapter.items()}
            out = peft_state(adapter, self.spec.family, self.lora, self.spec)
            return {k: v.to(dtype) for k, v in out.items()}
        # hundreds of matrices each version: one buffer and one multi-tensor cast
        return cast_together(peft_state(adapter, self.spec.family, self.lora, self.spec), dtype)

    def _groups(self) -> Iterator[tuple[str, torch.nn.Module]]:
        outside = torch.nn.ModuleDict(
            {n: m for n, m in self.model.named_children() if n != "layers"}
        )
        yield "", outside
        for index, block in self.model.layers.items():
            yield f"layers.{index}.", block

    def hf_state_dict(self) -> dict[str, Tensor]:
        """`hf_groups` joined: the whole model on rank 0, an empty dict on the other ranks
        (every rank must call it)."""
        state: dict[str, Tensor] = {}
        for group in self.hf_groups():
            state.update(group)
        return state

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and step, as full tensors on the CPU (any rank count
        restores them). With several ranks every rank must call it (each tensor is gathered in
        turn); only rank 0 keeps the full tensors, the other ranks return None in their place,
        so a host's CPU memory holds one copy of the state, not one per rank."""
        keep = self.rank == 0
        optim = self.optimizer.state_dict()
        optim["state"] = {
            i: {k: _gathered(v, keep) for k, v in s.items()} for i, s in optim["state"].items()
        }
        return {
            "model": {k: _gathered(v, keep) for k, v in self._model_state().items()},
            "optimizer": optim,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def _model_state(self) -> dict[str, Any]:
        """The model's part of the state: every weight, or a LoRA run's adapter alone."""
        if self.lora is None:
            return self.model.state_dict()
        return {k: v.detach() for k, v in trainer_state.trained(self.model).items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (each rank keeps its shard)."""
        current = self._model_state()
        if current.keys() != state["model"].keys():
            missing = sorted(current.keys() - state["model"].keys())[:5]
            extra = sorted(state["model"].keys() - current.keys())[:5]
            raise KeyError(f"checkpoint does not fit the model: missing {missing}, extra {extra}")
        # Through load_state_dict, not copies into state_dict() values: TorchTitan's fused QKV
        # projection saves q/k/v as split copies and merges them back in a load hook.
        self.model.load_state_dict(
            {name: _sharded_like(state["model"][name], like) for name, like in current.items()},
            strict=self.lora is None,
        )
        # Optimizer state is keyed by parameter index in param-group order.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        optim = dict(state["optimizer"])
        optim["state"] = {
            i: {k: _sharded_like(v, params[int(i)]) for k, v in s.items()}
            for i, s in optim["state"].items()
        }
        self.optimizer.load_state_dict(optim)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])


def _gathered(value: Any, keep: bool = True) -> Any:
    if not isinstance(value, Tensor):
        return value
    full = _full(value)  # a collective for a sharded tensor: every rank takes part
    return full.detach().cpu() if keep else None


def _sharded_like(value: Any, like: Tensor) -> Any:
    """A full tensor laid out like `like`: sharded the same way if `like` is a DTensor."""
    if not isinstance(value, Tensor) or value.shape != like.shape:
        return value  # e.g. AdamW's step counter
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = like.to_local()
        return distribute_tensor(
            value.to(device=local.device, dtype=local.dtype), like.device_mesh, like.placements
        )
    return value.to(device=like.device, dtype=like.dtype)


def _round_frozen_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A LoRA run's frozen projections stored in `dtype` on meta (no master copy to keep: they
    never change); the adapter, embeddings and norms stay fp32, and so does an output projection
    tied to the embedding (the lookup reads it unrounded)."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, torch.nn.Linear)
            and not weight.requires_grad
            and id(weight) not in tied
        ):
            module.weight.data = weight.data.to(dtype)
