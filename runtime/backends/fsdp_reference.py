"""The frozen reference on GPU(s): the initial policy scored in the trainer's precision, sharded
over its ranks (FSDP2) when it has several, micro-batched like the trainer (`FSDPTrainer`, whose
forward and row split it shares: runtime.backends.scoring)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.backends.blocks import wrap_blocks
from runtime.backends.fsdp_trainer import init_distributed
from runtime.backends.scoring import rank_rows, score_rows
from runtime.models import ModelSpec
from runtime.models.loading import WeightSource, as_source, load_into
from runtime.models.titan import materialize, meta_model


class GPUReference:
    """The frozen initial policy, scored in the single-rank trainer's precision; micro-batched.

    `dtype` is the compute dtype. Below fp32 the reference computes exactly what `FSDPTrainer`
    computes on one rank (fp32 master weights under `autocast(dtype)`), so their log-probs agree
    (same kernels on the same rounded operands) and the KL penalty starts at 0: autocast rounds
    every matmul weight to `dtype`, so those weights are stored rounded (half the memory), while
    embeddings and norm weights, which autocast leaves alone, stay fp32 and the residual stream
    stays fp32 with them. Storing every weight in bf16 instead (a plain bf16 model) rounds the
    embeddings, norms and residual stream too, which moves log-probs by a few bf16 ulps of the
    logits (~0.05 nats on peaked outputs). A trainer sharded over several ranks computes in
    FSDP2's `param_dtype` regime (norms in bf16 too), one such ulp away from this reference.
    `compile` runs each block through torch.compile, as the trainer's does.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        temperature: float = 1.0,
        weights: WeightSource | Mapping[str, Tensor] | None = None,
        seed: int = 0,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        tokens_per_micro_batch: int = 8192,
        compile: bool = False,
    ):
        self.spec = spec
        self.temperature = temperature
        self.device = torch.device(device)
        self.dtype = dtype
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.world = init_distributed()
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.model = meta_model(spec)
        if self.world > 1:
            # Sharded over the reference's GPUs (FSDP2): every weight stored in `dtype`, as a
            # sharded trainer computes (FSDP2's param_dtype regime), each rank 1/world of it.
            if dtype != torch.float32:
                for param in self.model.parameters():
                    param.data = param.data.to(dtype)
            self._shard()
        elif dtype != torch.float32:
            # The matmul weights get `dtype` storage while still on meta; the source's fp32
            # numbers are rounded once as they are copied in (what autocast does per matmul).
            _round_matmul_weights(self.model, dtype)
        materialize(self.model, self.device)
        load_into(self.model, as_source(weights, spec, seed), "the reference")
        self.model._skip_lm_head = True
        self.model.eval().requires_grad_(False)
        self.compiled = compile
        wrap_blocks(self.model, checkpointing=False, compile=compile)

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32 or self.world > 1:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def my_rows(self, batch: int) -> slice:
        return rank_rows(batch, self.rank, self.world)

    def warm_up(self, width: int) -> dict[str, float] | None:
        """Make a compiled reference's graphs before the first step (runtime.backends.warm_up):
        one micro-batch of made-up rows `width` tokens wide scored on every rank, which must
        all call it. None where nothing compiles."""
        from runtime.backends.warm_up import compile_ahead, synthetic_rows

        if not self.compiled:
            return None
        tokens, mask = synthetic_rows(self.spec.vocab_size, width, self.tokens_per_micro_batch)
        # every rank scores its share of the rows: the micro-batch on each
        tokens, mask = tokens.repeat(self.world, 1), mask.repeat(self.world, 1)
        return compile_ahead(lambda: self.logprobs(tokens, mask), self.device)

    def logprobs(self, tokens: Tensor, response_mask: Tensor) -> Tensor:
        """Teacher-forced log-probs `[B, T]` of the reference (0 off the response); with
        several ranks, of this rank's rows (`my_rows`): every rank must call it."""
        if self.world > 1:
            rows = self.my_rows(tokens.shape[0])
            tokens, response_mask = tokens[rows], response_mask[rows]
        return score_rows(
            self.model,
            tokens,
            response_mask,
            temperature=self.temperature,
            tokens_per_micro_batch=self.tokens_per_micro_batch,
            device=self.device,
            world=self.world,
            precision=self._autocast(),
        )


def _round_matmul_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store the weights autocast would cast per matmul in `dtype` (the same rounding, once).

    A projection tied to the embedding keeps fp32: the embedding lookup reads it unrounded.
    """
    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in tied:
            module.weight.data = module.weight.data.to(dtype)
