"""The sections that say where and how the services run: `layout` (which service gets how
many GPUs, and which share them), `resources` (the GPU type, the node's disk), and each
service's own settings (`generator`, `trainer`, `reference`, `weight_sync`, `watchdog`), whose
"auto" values are planned from the GPU type and the layout (recipes/settings.py).

Each check here sees one section; checks across sections live in recipes/schema.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from recipes.fields import Strict
from recipes.gpus import GPU_TYPES


class GeneratorLayout(Strict):
    tp: int = Field(default=1, ge=1)
    replicas: int = Field(default=1, ge=1)


class ReferenceLayout(Strict):
    enabled: bool = True
    # The frozen model is sharded over its GPUs (FSDP2, bf16), one process per GPU, like the
    # trainer's; each scores its share of a batch's rows.
    gpus: int = Field(default=1, ge=1)
    # gpu, or cpu: the reference scores in float32 on node 0's CPU cores, taking no GPU (slow:
    # for small models where a GPU is dearer than the time; the host needs the memory), or
    # trainer: a LoRA run's reference is its frozen base with the adapter off, scored in the
    # trainer's processes on the trainer's GPUs (no GPU and no copy of the model of its own)
    device: Literal["gpu", "cpu", "trainer"] = "gpu"
    # Where services share GPUs (layout.share all or trainer_reference), the planner also
    # weighs the reference sharded over every GPU the trainer has (its rows split over more
    # ranks: a shorter turn, a smaller shard on each GPU) and keeps the faster that fits.
    spread: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.enabled and self.device == "gpu"

    @property
    def on_cpu(self) -> bool:
        return self.enabled and self.device == "cpu"

    @property
    def in_trainer(self) -> bool:
        """Scored by the trainer's processes (a LoRA run): neither on a GPU of its own nor on
        the CPU, so `on_gpu` and `on_cpu` are both false."""
        return self.enabled and self.device == "trainer"


class TrainerLayout(Strict):
    # The trainer shards its weights, gradients and optimizer state over its GPUs (FSDP2).
    gpus: int = Field(default=1, ge=1)


class RewardLayout(Strict):
    procs: int = Field(default=1, ge=1)


# Which GPU services share GPUs (and take turns on them): none (every service on GPUs of its
# own), trainer_reference (the generators on GPUs of their own, the trainer and the reference
# sharing the rest), all (every service on every GPU of one node), or auto: the planner
# predicts each that fits and takes the fastest (recipes/costs.py; `forgesky plan --explain`).
Share = Literal["auto", "none", "trainer_reference", "all"]


# How services placed on one GPU use it: turns (one GPU call at a time: a generate call, a
# scoring, a train step with its publish, a weight load; runtime/control/turns.py), or mps
# (their calls at once, as clients of an NVIDIA MPS daemon the run starts on its node:
# runtime/procs/mps.py; without MPS, processes on one GPU are time-sliced, which measured slower
# than turns). The predicted step counts turns; the memory check adds up every service's
# working memory on a GPU either way.
Sharing = Literal["turns", "mps"]


class MpsSmPercent(Strict):
    """Under layout.sharing mps, the share of the GPU's SMs each service's kernels may use (in
    %: NVIDIA MPS's active thread percentage, set for that service's procs). 100 is all of them,
    as without a limit; less leaves the others room, e.g. the generator's decode beside the
    trainer's step."""

    generator: int = Field(default=100, ge=1, le=100)
    reference: int = Field(default=100, ge=1, le=100)
    trainer: int = Field(default=100, ge=1, le=100)

    def limited(self) -> tuple[tuple[str, int], ...]:
        """The services held below 100 %, with their share."""
        return tuple((name, pct) for name, pct in self.model_dump().items() if pct < 100)


class Layout(Strict):
    generator: GeneratorLayout = GeneratorLayout()
    reference: ReferenceLayout = ReferenceLayout()
    trainer: TrainerLayout = TrainerLayout()
    reward: RewardLayout = RewardLayout()
    share: Share = "auto"
    sharing: Sharing = "turns"
    mps_sm_percent: MpsSmPercent = MpsSmPercent()


class Resources(Strict):
    # a GPU type of recipes/gpus.py, or cpu
    accelerator: Literal[(*GPU_TYPES, "cpu")] = "H100"  # type: ignore[valid-type]
    alternatives: list[Literal[GPU_TYPES]] = ["H200"]  # type: ignore[valid-type]
    # each node's disk; auto: what the run writes (recipes/memory.py disk_plan)
    disk_gb: int | Literal["auto"] = "auto"

    _disk = field_validator("disk_gb")(lambda value: _at_least_one(value))
    gpus_per_node: int = Field(default=8, ge=1, le=64)
    # what a node costs an hour in US dollars, and where that price comes from: `launch` sets
    # both from the plan's price (recipes/prices.py; spot with --spot), and the run's metrics
    # carry the dollars spent so far (cost/usd); absent, the run counts no dollars
    usd_per_node_hour: float | None = Field(default=None, ge=0)
    price_source: str = ""


Auto = Literal["auto"]


def _at_least_one(value: int | str) -> int | str:
    if value != "auto" and value < 1:
        raise PydanticCustomError("positive", "must be >= 1 or auto, got {v}", {"v": value})
    return value


class GeneratorSettings(Strict):
    """How each generator samples. "auto" values are planned (`forgesky plan` shows them)."""

    # vLLM on GPUs, transformers' generate on CPU
    backend: Literal["auto", "vllm", "hf"] = "auto"
    # vLLM's share of its GPU; with a fixed kv_cache_gb only the share that must be free to start
    gpu_memory_utilization: float | Auto = "auto"
    # a fixed KV cache (GB per GPU) instead of vLLM's profiling: planned when services share
    # the generator's GPU, whose free memory profiling would misread
    kv_cache_gb: float | Auto = "auto"
    # no torch.compile / CUDA graphs: a faster start, slower decoding
    enforce_eager: bool = False
    # where vLLM's engine core runs: in the generator's process (its engine loop shares that
    # process's GIL with the actor's threads) or in a process of its own, vLLM's default (one
    # more process and CUDA context; weights cross by CUDA IPC handle or a file in /dev/shm)
    engine: Literal["in-process", "separate"] = "in-process"
    # A LoRA run's adapter kernels in vLLM (model.lora, vLLM generators only), both vLLM's own
    # options, off as vLLM ships them: `lora_dual_stream` runs each layer's adapter on a second
    # CUDA stream beside the base layer's matmul (VLLM_LORA_ENABLE_DUAL_STREAM);
    # `lora_specialize_active` captures CUDA graphs per count of adapters in use (its
    # specialize_active_lora), so a generation with one adapter launches the kernels' grid for
    # one rather than for every slot. On qwen3-8b-lora (one H200, 2026-12-02) both together
    # generated 1-2.5 % faster and started the engine 4 minutes later: off by default
    lora_dual_stream: bool = False
    lora_specialize_active: bool = False

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _share(cls, value: float | str) -> float | str:
        if value != "auto" and not 0 < value <= 1:
            raise PydanticCustomError("share", "must be in (0, 1] or auto, got {v}", {"v": value})
        return value

    @field_validator("kv_cache_gb")
    @classmethod
    def _positive(cls, value: float | str) -> float | str:
        if value != "auto" and value <= 0:
            raise PydanticCustomError("positive", "must be > 0 or auto, got {v}", {"v": value})
        return value


class TrainerSettings(Strict):
    """How the trainer computes. "auto" values are planned for the GPU (`forgesky plan`)."""

    # trainer processes (FSDP ranks): one per trainer GPU; on a CPU recipe, gloo ranks
    ranks: int | Auto = "auto"
    # tokens per micro-batch (gradients accumulate): the largest that fits the GPU
    tokens_per_micro_batch: int | Auto = "auto"
    # recompute each block in backward (a third more FLOPs, much less memory): where needed
    activation_checkpointing: bool | Auto = "auto"
    # torch.compile each block and the output projection: on GPUs
    compile: bool | Auto = "auto"
    # several ranks: gather the weights and reduce the gradients once a step instead of once a
    # micro-batch (an unsharded bf16 copy of the weights and fp32 gradients a rank): where it fits
    gather_once: bool | Auto = "auto"
    # profile this optimizer step under torch.profiler on every trainer rank (0: none): GPU time
    # by kind of kernel in RUN_DIR/profile/ (runtime.backends.profiling)
    profile_step: int = 0

    _positive = field_validator("ranks", "tokens_per_micro_batch")(_at_least_one)

    @field_validator("profile_step")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise PydanticCustomError(
                "not_negative", "must be a step (1 or more) or 0 for none, got {v}", {"v": value}
            )
        return value


class ReferenceSettings(Strict):
    """How the reference scores (forward only)."""

    # reference processes (FSDP ranks): one per reference GPU; on a CPU recipe, gloo ranks
    ranks: int | Auto = "auto"
    tokens_per_micro_batch: int | Auto = "auto"
    compile: bool | Auto = "auto"

    _positive = field_validator("ranks", "tokens_per_micro_batch")(_at_least_one)


class WeightSyncSettings(Strict):
    """How policy versions reach the generators (runtime/weights/transport.py)."""

    # auto: CUDA IPC on the trainer's GPU, NCCL push to other GPUs, TorchStore on CPU;
    # store: always TorchStore; push: also on CPU (over gloo)
    transport: Literal["auto", "store", "push"] = "auto"
    # where generators take the push path alone, how a version leaves trainer rank 0: version
    # (staged whole in one buffer beside its shards, sent while it trains on), groups (each
    # group's tensors sent as they are gathered, one group in flight: no copy of a version),
    # or auto: version where the trainer holds that buffer, else groups
    push_buffer: Literal["auto", "version", "groups"] = "auto"
    # a weight-push collective whose peer died fails after this many seconds
    timeout_s: float = Field(default=300.0, gt=0)


class WatchdogSettings(Strict):
    """How long the controller waits for a service's answer before it calls the service stuck
    (a wedged collective, a hung kernel) and ends the run (runtime/control/watchdog.py)."""

    # the first call of each kind (start-up, compiling, the first checkpoint or export)
    first_call_s: float = Field(default=1800.0, gt=0)
    # a later call: this many times the slowest answer of its kind so far, ...
    factor: float = Field(default=10.0, ge=1)
    # ... and never less than this
    min_s: float = Field(default=300.0, gt=0)
