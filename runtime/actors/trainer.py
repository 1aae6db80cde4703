"""The trainer actor: owns the policy and its optimizer, publishes each policy version.

With several trainer ranks (one proc per trainer GPU) every endpoint is called on all of them:
the backend's forward, backward and weight gathers are collectives. Rank 0 alone speaks for the
service: it publishes, serves the weight paths and writes the checkpoint; the controller reads
its answers (`runtime.control.services.Services.train_call`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from monarch.actor import Actor, endpoint

from runtime.backends import build
from runtime.backends.scoring import response_lists
from runtime.procs.failures import ranked
from runtime.procs.mps import client_sm_percent


class TrainerActor(Actor):
    def __init__(self) -> None:
        self.backend: Any = None
        self.store: Any = None
        self.recipe: Any = None
        self.settings: Any = None
        # How versions leave rank 0 (runtime.weights.transport.Publisher): the store until the
        # controller connects the generators' paths.
        self.publisher: Any = None
        self._layout: Any = None  # the published flat layout, from the backend (`hf_layout`)

    @endpoint
    @ranked
    async def setup(self, recipe: Any, settings: Any, store: Any) -> dict[str, Any]:
        """Build the model (pretrained or seeded init) and the optimizer; join the other ranks.
        `settings`: the plan's recipes.settings.Settings."""
        self.recipe, self.settings, self.store = recipe, settings, store
        torch.manual_seed(recipe.seed)
        spec = build.model_spec(recipe)
        if recipe.kind == "grpo":
            from runtime.grpo import resolve_loss

            resolve_loss(recipe.grpo.loss)  # a loss of the user's: imported now, not at step 1
        self.backend = build.TrainerConfig(recipe, settings.trainer).build()
        # The host copy checkpoints are staged into, made (on a GPU: pinned) in the background
        # while the other services start rather than beside a checkpoint's training steps
        # (runtime.backends.trainer_state.Saver.prepare).
        prepare = getattr(self.backend, "prepare_checkpoint_copy", None)
        copy = bool(prepare is not None and prepare())
        return {
            "checkpoint_copy": copy,
            "params": spec.num_params(),
            "device": str(build.device()),
            "backend": type(self.backend).__name__,
            "ranks": getattr(self.backend, "world", 1),
            "tokens_per_micro_batch": getattr(self.backend, "tokens_per_micro_batch", None),
            "activation_checkpointing": getattr(self.backend, "activation_checkpointing", None),
            "gather_once": getattr(self.backend, "gather_once", False),
            "mps_sm_percent": client_sm_percent(),
        }

    @endpoint
    @ranked
    async def warm_up(self, width: int) -> dict[str, float] | None:
        """A compiled trainer's graphs made before the first step, on a micro-batch of made-up
        rows `width` tokens wide (runtime.backends.warm_up); called while the generators start.
        None where nothing compiles (the CPU's trainer, `trainer.compile` off, SFT)."""
        warm = getattr(self.backend, "warm_up", None)
        if warm is None or self.recipe.kind != "grpo":
            return None
        return warm(width, 2 if self.recipe.grpo.entropy_coef else 1)

    def _measured(self, step: Any) -> dict[str, Any]:
        """`step()`'s stats with the events seen during it, run under torch.profiler on the
        step the recipe's `trainer.profile_step` names (runtime.backends.profiling)."""
        from runtime.backends.profiling import measured_step

        profile = self.recipe.trainer.profile_step == self.backend.step + 1
        return measured_step(step, build.device(), profile)

    @endpoint
    @ranked
    async def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        """One optimizer step on a batch (runtime.control.batching.train_batch); each rank
        trains on its share of the rows, the stats cover the whole batch."""
        from runtime.grpo import LossConfig, policy_loss

        g = self.recipe.grpo
        start = time.perf_counter()
        stats = self._measured(
            lambda: self.backend.train_step(
                batch["tokens"],
                batch["response_mask"],
                batch["advantages"],
                batch["old_logprobs"],
                batch["ref_logprobs"],
                policy_loss,
                config=LossConfig.from_grpo(g),
                max_response_tokens=g.max_response_tokens,
                loss_mask=batch.get("loss_mask"),
            )
        )
        stats["time/train_s"] = time.perf_counter() - start
        memory = getattr(self.backend, "memory", None)
        return stats | (memory.metrics() if memory is not None else {})

    @endpoint
    @ranked
    async def sft_step(self, packs: list[Any]) -> dict[str, float]:
        """One optimizer step of SFT (runtime.sft.run): every rank is given the step's packed
        micro-batches and trains on its share of them (`FSDPTrainer.sft_step`); the loss is
        over the step's trained tokens on every rank, as on one process."""
        start = time.perf_counter()
        stats = self._measured(lambda: self.backend.sft_step(packs))
        stats["time/train_s"] = time.perf_counter() - start
        memory = getattr(self.backend, "memory", None)
        return stats | (memory.metrics() if memory is not None else {})

    @endpoint
    @ranked
    async def sft_loss(self, packs: list[Any]) -> tuple[float, int]:
        """The summed loss of `packs`' trained tokens and their count, no step (SFT's held-out
        loss); every rank scores its share and answers the whole sum."""
        return self.backend.sft_loss(packs)

    @endpoint
    @ranked
    async def reference_logprobs(
        self, tokens: torch.Tensor, response_mask: torch.Tensor
    ) -> dict[str, Any]:
        """A LoRA run's reference, in the trainer's processes: the base's (the adapter off)
        log-prob of every response token, one list per row, answered as
        `ReferenceActor.logprobs` answers. With several ranks every rank is called and answers
        for its share of the rows (`first`: where it starts)."""
        start = time.perf_counter()
        rows_of = getattr(self.backend, "my_rows", None)
        share = rows_of(tokens.shape[0]) if rows_of else slice(0, tokens.shape[0])
        lp = self.backend.reference_logprobs(tokens, response_mask)
        rows = response_lists(lp, response_mask[share])
        return {"logprobs": rows, "first": share.start, "seconds": time.perf_counter() - start}

    def _rank(self) -> int:
        return getattr(self.backend, "rank", 0)

    def _phase(self, name: str) -> contextlib.AbstractContextManager:
        """Measure the GPU peak of `name` (runtime.backends.gpu_memory; the step metrics carry
        it as memory/<name>_gb), where the backend keeps such records."""
        memory = getattr(self.backend, "memory", None)
        return memory.phase(name) if memory is not None else contextlib.nullcontext()

    @endpoint
    @ranked
    async def weight_endpoint(self) -> Any:
        """Where this trainer's published weights live (host, GPU)."""
        from runtime.weights.transport import endpoint

        return endpoint()

    @endpoint
    @ranked
    async def connect_weights(
        self, paths: list[str], ipc_opens: list[int] | None = None
    ) -> dict[str, Any]:
        """Serve the generators' weight paths (one per generator, see
        runtime.weights.transport; `ipc_opens`: how many processes of each open a version);
        what their receivers need, by path (rank 0)."""
        from runtime.weights.transport import Publisher

        if self._rank() != 0:
            return {}
        if self.publisher is not None:
            self.publisher.close()
        sync = self.settings.weight_sync
        groups = sync.push_buffer == "groups"
        self.publisher = Publisher(
            self.store, paths, build.device(), sync.timeout_s, ipc_opens, push_groups=groups
        )
        return self.publisher.open()

    @endpoint
    @ranked
    async def publish(self, version: int) -> dict[str, float]:
        """Make the current weights (HF names) `version`: sent by every path in use, then
        indexed in the store."""
        # A group at a time (outside the blocks, then each block); with several ranks each
        # group is a collective every rank takes part in, and only rank 0 keeps it.
        groups = getattr(self.backend, "hf_groups", None)
        with self._phase("publish"):
            layout_of = getattr(self.backend, "hf_layout", None)
            if layout_of is not None and self._layout is None:
                # every rank alike: a block's state dict read on rank 0 alone put the ranks'
                # next gathers out of step (seen with two gloo ranks)
                self._layout = layout_of()
            parts = groups() if groups is not None else iter([self.backend.hf_state_dict()])
            if self._rank() != 0:
                for _ in parts:
                    pass
                return {"bytes": 0, "seconds": 0.0}
            if self.publisher is None:
                from runtime.weights.transport import Publisher

                self.publisher = Publisher(self.store, ["store"], build.device())
            if self.publisher.entries is None and self._layout is not None:
                self.publisher.set_layout(self._layout)
            return await self.publisher.publish_groups(version, parts)

    @endpoint
    @ranked
    async def version_loaded(self, version: int) -> None:
        """Every generator has loaded `version` (runtime.weights.transport.Publisher.loaded)."""
        if self._rank() == 0 and self.publisher is not None:
            self.publisher.loaded(version)

    @endpoint
    @ranked
    async def drop(self, version: int) -> None:
        if self._rank() == 0 and self.publisher is not None:
            await self.publisher.drop(version)

    @endpoint
    @ranked
    async def close_weights(self) -> None:
        """Stop serving the direct paths (the receivers' threads end)."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    @endpoint
    @ranked
    async def save(self, directory: str) -> None:
        """Start writing model, optimizer, scheduler and step into a checkpoint directory:
        every rank its own shards (runtime.backends.trainer_state). Returns at once: the state
        is copied to host memory in the background (the next optimizer step waits for the
        copy); `saved` says when the files are on disk."""
        with self._phase("checkpoint"):
            self.backend.save_checkpoint(directory)

    @endpoint
    @ranked
    async def saved(self, wait: bool) -> bool:
        """Whether the last checkpoint write is on disk on every rank; with `wait`, once it
        is (every rank answers the same)."""
        return self.backend.checkpoint_written(wait)

    @endpoint
    @ranked
    async def export(self, directory: str, provenance: dict[str, Any]) -> None:
        """Write the policy as a Hugging Face model folder (runtime.models.export), or a LoRA
        run's adapter as a PEFT folder (runtime.models.peft_format): the gather
        is on every rank, a group at a time; rank 0 writes each safetensors file as soon as its
        groups have come, so its host memory holds one file's weights, not the model."""
        groups = getattr(self.backend, "hf_groups", None)
        with self._phase("export"):
            if groups is None:  # the one-process CPU trainer: the whole model at once
                state = self.backend.hf_state_dict()
                layout = {k: v.to("meta") for k, v in state.items()}
                source = iter([state])
            else:
                # every rank alike: FSDP2's first state_dict of a module (its lazy init) joins
                # the ranks' group, so one rank alone would take the gathers out of step
                layout = self.backend.hf_layout()
                if self._rank() != 0:
                    for _ in groups():  # every rank joins each group's gather
                        pass
                    return
                source = groups()
            if self.recipe.model.lora is not None:
                # a LoRA policy is its adapter (PEFT names, small): one PEFT folder
                adapter = {k: v for group in source for k, v in group.items()}
                build.write_adapter(self.recipe, adapter, directory, provenance)
                return
            build.write_model(self.recipe, source, layout, directory, provenance)

    @endpoint
    @ranked
    async def load(self, directory: str) -> int:
        """Restore from a checkpoint directory, resharded to this trainer's ranks; returns the
        restored optimizer step. Every rank reads only what its shards need."""
        self.backend.load_checkpoint(directory)
        return self.backend.step
