"""The services' settings of a run: the recipe's `generator`, `trainer`, `reference` and
`weight_sync` sections with every "auto" planned for the layout and the GPU type.

`plan()` calls `plan_settings`, so `forgesky plan` shows what a run will use and the runtime
builds its services from exactly that (it plans again on the node, with the GPU it found).
A value the recipe sets is kept; an "auto" is filled in from the others, never the other way
round, and a setting that cannot fit is refused with its memory arithmetic.

Planned values:
- generator.backend: vllm on GPUs, hf (transformers) on CPU.
- generator.kv_cache_gb / gpu_memory_utilization: a generator with GPUs to itself lets vLLM
  profile its memory and take 0.85 of the GPU, less where it takes the push path: the buffer it
  receives each version into (2 bytes a parameter, on its first GPU) and 3 GB must stay free
  beside vLLM (qwen3-8b on an H100: 0.77; where vLLM would then not hold its weights and one
  group's KV cache, "auto" plans the store path); one that shares a GPU with another service gets
  a fixed KV cache (the memory model's reserve, recipes/memory.py) and must find 0.05 of the
  GPU free at start (profiling would count the neighbours' memory as its own).
- trainer.ranks: one process per trainer GPU (1 on CPU).
- reference.ranks: one process per reference GPU (1 on CPU), the frozen model sharded over them.
- trainer.tokens_per_micro_batch / activation_checkpointing: the largest micro-batch that
  fits, without checkpointing if it can (`trainer_memory_plan`), in the GPU less what stays on
  it beside the trainer (the push path's buffer; on a shared GPU also the generator's weights
  and fixed KV cache and the reference); a shared trainer that fits none of those takes 8192
  tokens with checkpointing (the planner then checks that step against the device); on a CPU
  8192 without.
- trainer.compile, reference.compile: on GPUs.
- trainer.gather_once: several trainer ranks on GPUs gather the weights once a step and reduce
  the gradients once (FSDP2 without resharding or gradient sync between micro-batches), where
  that step still fits at the micro-batch and checkpointing planned without it
  (`gather_once_fits`); one all-gather and one reduce-scatter a step instead of one each a
  micro-batch.
- reference.tokens_per_micro_batch: the trainer memory plan of a one-rank trainer on the
  reference's GPU (the reference holds less, so this is conservative); 8192 when shared.
  A reference in the trainer's processes (a LoRA run's) takes the trainer's ranks, micro-batch
  and compile.
- generator max_lora_rank / max_loras (a LoRA run on vLLM): the smallest rank vLLM allows at
  least model.lora.rank, and two adapters at once (recipes/lora.py); they follow from the recipe,
  as do generator.lora_dual_stream / lora_specialize_active (shown where on).
- weight_sync.transport stays "auto" until the run starts: each generator's path then follows
  where it and the trainer are (`plan` shows the path it expects). Where generators take the
  push path alone, weight_sync.push_buffer "version" sends each version from a flat buffer
  (2 bytes a parameter on trainer rank 0: `push_buffer_bytes`), with the trainer's
  micro-batch planned with that buffer taken off its GPU; where that buffer leaves a trainer
  on GPUs of its own no micro-batch that fits, "groups": each group's tensors go out as the
  trainer gathers them, with no buffer on the trainer (slower, still a fraction of a second:
  qwen3-8b over NCCL on two H200s 0.112 s a version against 0.079 s whole). "store" (a
  version streamed a block at a time) where a generator cannot hold its own receive buffer
  beside vLLM.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from recipes.errors import DoesNotFit, UserError
from recipes.lora import VLLM_MAX_LORAS, max_lora_rank
from recipes.memory import (
    ACCELERATOR_BYTES,
    GB,
    PLAN_HEADROOM,
    PLAN_TOKENS,
    RUNTIME_OVERHEAD_GB,
    gather_once_fits,
    generator_weights_gb,
    kv_gb,
    lora_generator_bytes,
    planned_peak,
    shared_generator_gb,
    trainer_fixed_bytes,
    trainer_memory_plan,
    trainer_token_bytes,
    version_bytes,
)

SHARED_TOKENS = 8192
ALONE_GPU_SHARE = 0.85
SHARED_START_SHARE = 0.05


@dataclass(frozen=True)
class GeneratorSettings:
    backend: str
    gpu_memory_utilization: float
    kv_cache_gb: float | None  # None: vLLM profiles the GPU
    enforce_eager: bool
    engine: str  # vLLM's engine core: in-process or separate
    # a LoRA run on vLLM: the engine's adapter rank and how many adapters it holds at once,
    # and its adapter kernels' options (the recipe's generator.lora_*)
    max_lora_rank: int | None = None
    max_loras: int | None = None
    lora_dual_stream: bool | None = None
    lora_specialize_active: bool | None = None


@dataclass(frozen=True)
class TrainerSettings:
    ranks: int
    tokens_per_micro_batch: int
    activation_checkpointing: bool
    compile: bool
    # several ranks: the weights gathered and the gradients reduced once a step, not each
    # micro-batch (recipes.memory.gather_once_fits)
    gather_once: bool = False
    peak_gb: float | None = None  # the memory plan's estimate for one rank (GPU alone)
    note: str | None = None  # why the plan took what it took, where that is not a fit


@dataclass(frozen=True)
class ReferenceSettings:
    ranks: int
    tokens_per_micro_batch: int
    compile: bool


@dataclass(frozen=True)
class WeightSyncSettings:
    transport: str
    timeout_s: float
    # version | groups where generators take the push path alone; none elsewhere
    push_buffer: str = "none"
    expected: tuple[str, ...] = ()  # the path each generator should take (plan display)


@dataclass(frozen=True)
class Settings:
    """Every service's settings for one plan; `planned` names the values that were "auto"."""

    generator: GeneratorSettings
    trainer: TrainerSettings
    reference: ReferenceSettings
    weight_sync: WeightSyncSettings
    planned: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in _LORA_ONLY:  # a run that trains every parameter has none of them
            if d["generator"][key] is None:
                del d["generator"][key]
        d["planned"] = list(self.planned)
        d["weight_sync"]["expected"] = list(self.weight_sync.expected)
        return d

    def describe(
        self, cpu: bool = False, reference: bool = True, reference_in_trainer: bool = False
    ) -> list[str]:
        """One line per service: `key value`, marked `*` where planned (GPU-only settings
        left out on CPU, the reference's where there is none)."""
        lines = []
        for section in ("generator", "trainer", "reference", "weight_sync"):
            if section == "reference" and not reference:
                continue
            parts = []
            for key, value in asdict(getattr(self, section)).items():
                if key in ("peak_gb", "note", "expected") or (cpu and key in _GPU_ONLY):
                    continue
                if key == "gather_once" and self.trainer.ranks < 2:
                    continue  # one rank gathers nothing
                if key == "push_buffer" and value == "none":
                    continue
                if key in _LORA_ONLY and value is None:
                    continue
                if key in _LORA_KERNELS and not value:
                    continue  # vLLM's default; shown where the recipe turns one on
                if key == "kv_cache_gb" and value is None:
                    value = "profiled"
                elif isinstance(value, bool):
                    value = "on" if value else "off"
                elif isinstance(value, float):
                    value = f"{value:g}"
                mark = "*" if f"{section}.{key}" in self.planned else ""
                parts.append(f"{key} {value}{mark}")
            line = f"  {section:<12}{', '.join(parts)}"
            if section == "trainer" and self.trainer.peak_gb is not None:
                line += f" (~{self.trainer.peak_gb:.0f} GB a rank)"
            if section == "trainer" and self.trainer.note:
                line += f" ({self.trainer.note})"
            if section == "reference" and reference_in_trainer:
                line += " (in the trainer's processes: its ranks, micro-batch and compile)"
            if section == "weight_sync" and self.weight_sync.expected:
                line += f" (expected: {', '.join(self.weight_sync.expected)})"
            lines.append(line)
        return lines


_GPU_ONLY = ("gpu_memory_utilization", "kv_cache_gb", "enforce_eager", "engine", "compile")
_LORA_KERNELS = ("lora_dual_stream", "lora_specialize_active")
_LORA_ONLY = ("max_lora_rank", "max_loras", *_LORA_KERNELS)


def plan_settings(
    recipe: Any,
    *,
    accelerator: str,
    shared: frozenset[str],
    trainer_gpus: int,
    generator_replicas: int,
    expected_paths: tuple[str, ...] = (),
    beside_trainer: frozenset[str] = frozenset(),
    kv_cap_gb: float | None = None,
) -> Settings:
    """The recipe's settings with every "auto" planned.

    `shared`: the services ("generator", "trainer", "reference") whose GPUs another service
    also uses; `beside_trainer`: those on the trainer's GPUs; `trainer_gpus` and
    `generator_replicas` as planned; `accelerator` the GPU type ("cpu" for a CPU plan);
    `kv_cap_gb` caps a planned KV cache (what leaves the trainer's step room on its GPU).
    """
    cpu = accelerator == "cpu"
    planned: list[str] = []

    def pick(section: str, key: str, value: Any) -> Any:
        given = getattr(getattr(recipe, section), key)
        if given != "auto":
            return given
        planned.append(f"{section}.{key}")
        return value

    gen = recipe.generator
    backend = pick("generator", "backend", "hf" if cpu else "vllm")
    if cpu and backend == "vllm":
        raise UserError(
            "generator.backend vllm needs a GPU, and this plan has none (--gpus 0): "
            "use generator.backend hf (or auto) on CPU"
        )
    kv_auto = None
    if not cpu and "generator" in shared:
        kv_auto = _kv_reserve_gb(recipe, generator_replicas)
        if kv_cap_gb is not None:
            kv_auto = min(kv_auto, kv_cap_gb)
    kv = pick("generator", "kv_cache_gb", kv_auto)
    share = pick(
        "generator",
        "gpu_memory_utilization",
        SHARED_START_SHARE if kv is not None else ALONE_GPU_SHARE,
    )
    if not cpu and kv is not None:
        _check_kv(recipe, accelerator, kv)
    lora = recipe.model.lora
    slots: tuple[int | bool | None, ...] = ()
    if lora is not None and backend == "vllm":
        slots = (
            max_lora_rank(lora.rank),
            VLLM_MAX_LORAS,
            gen.lora_dual_stream,
            gen.lora_specialize_active,
        )
    generator = GeneratorSettings(backend, share, kv, gen.enforce_eager, gen.engine, *slots)

    ranks = pick("trainer", "ranks", 1 if cpu else trainer_gpus)
    sync = recipe.weight_sync
    transport, reserve, held = sync.transport, 0.0, 0.0
    flat = 0.0 if cpu else push_buffer_bytes(recipe, transport, expected_paths, sync.push_buffer)

    def by_store() -> tuple[str, tuple[str, ...], float]:
        """Where "auto" gives way to the store: transport, each generator's path, no buffer."""
        return pick("weight_sync", "transport", "store"), ("store",) * len(expected_paths), 0.0

    buffer = sync.push_buffer
    if flat and "trainer" not in shared:
        room = ACCELERATOR_BYTES[accelerator] - flat
        if trainer_memory_plan(recipe.arch, ranks, room, lora=lora) is None:
            if buffer == "version":
                raise DoesNotFit(
                    f"weight_sync.push_buffer version: a whole version ({flat / GB:.1f} GB) "
                    f"beside trainer rank 0's shards leaves it no micro-batch that fits an "
                    f"{accelerator}; leave it auto (a group at a time, no buffer on the trainer)"
                )
            buffer, flat = "groups", 0.0  # no whole version beside the trainer
    receive = 0.0 if cpu or kv is not None else push_receive_bytes(recipe, expected_paths)
    if receive:
        room = _share_beside(accelerator, receive)
        least = _least_share(recipe, accelerator)
        if "generator.gpu_memory_utilization" not in planned and share > room:
            raise DoesNotFit(
                f"generator.gpu_memory_utilization: {share:g} of an {accelerator} leaves "
                f"{(1 - share) * ACCELERATOR_BYTES[accelerator] / GB:.1f} GB beside vLLM, and "
                f"the push path receives each version into a {receive / GB:.1f} GB buffer on "
                f"the generator's first GPU (with {RUNTIME_OVERHEAD_GB:.0f} GB for the "
                f"process): set it to at most {room:g}, or weight_sync.transport=store"
            )
        if room < least and transport == "auto" and sync.push_buffer == "auto":
            # vLLM would not hold its weights and one group's KV cache beside the buffer
            transport, expected_paths, flat = by_store()
        elif room < least:
            raise DoesNotFit(
                f"the push path: a {receive / GB:.1f} GB receive buffer on the generator's "
                f"first GPU leaves vLLM {room:g} of an {accelerator}, less than the {least:g} its "
                "weights and one group's KV cache need; use weight_sync.transport=store"
            )
        elif "generator.gpu_memory_utilization" in planned and share > room:
            share = room
            generator = GeneratorSettings(backend, share, kv, gen.enforce_eager, gen.engine, *slots)
    reserve = flat
    if not cpu and "trainer" in shared:
        # what stays on the trainer's GPUs through its turn: the others' weights and caches
        reserve += _resident_bytes(recipe, beside_trainer, kv)
    if not cpu:
        held = ipc_buffer_held(recipe, transport, expected_paths)
    tokens, ckpt, peak, note = _trainer_plan(
        recipe, accelerator, ranks, "trainer" in shared, reserve, held
    )
    tokens = pick("trainer", "tokens_per_micro_batch", tokens)
    ckpt = pick("trainer", "activation_checkpointing", ckpt)
    compiled = pick("trainer", "compile", not cpu)
    gather = pick(
        "trainer",
        "gather_once",
        not cpu
        and gather_once_fits(
            recipe.arch,
            ranks,
            ACCELERATOR_BYTES[accelerator] - reserve - held,
            tokens,
            ckpt,
            compiled,
            recipe.model.lora,
        ),
    )
    if peak is not None:
        peak = planned_peak(
            peak, bool(gather), recipe.arch, ranks, tokens, ckpt, compiled, recipe.model.lora
        )
    trainer = TrainerSettings(
        ranks=ranks,
        tokens_per_micro_batch=tokens,
        activation_checkpointing=ckpt,
        compile=compiled,
        gather_once=bool(gather) and ranks > 1,
        peak_gb=None if peak is None else round(peak / GB, 1),
        note=note,
    )

    ref_tokens = SHARED_TOKENS
    ref_gpu = not cpu and recipe.layout.reference.on_gpu
    if ref_gpu and "reference" not in shared:
        fit = trainer_memory_plan(recipe.arch, 1, ACCELERATOR_BYTES[accelerator])
        ref_tokens = fit[0] if fit else SHARED_TOKENS
    ref_ranks, ref_compile = recipe.layout.reference.gpus if ref_gpu else 1, ref_gpu
    if recipe.layout.reference.in_trainer:  # the trainer's processes score it
        ref_ranks, ref_tokens = trainer.ranks, trainer.tokens_per_micro_batch
        ref_compile = trainer.compile
    reference = ReferenceSettings(
        ranks=pick("reference", "ranks", ref_ranks),
        tokens_per_micro_batch=pick("reference", "tokens_per_micro_batch", ref_tokens),
        compile=pick("reference", "compile", ref_compile),
    )
    push_buffer = _push_buffer(buffer, transport, expected_paths)
    if sync.push_buffer == "auto" and push_buffer != "none":
        planned.append("weight_sync.push_buffer")
    weight_sync = WeightSyncSettings(
        transport, sync.timeout_s, push_buffer=push_buffer, expected=expected_paths
    )
    return Settings(generator, trainer, reference, weight_sync, tuple(planned))


def pushes_alone(transport: str, expected_paths: tuple[str, ...]) -> bool:
    """Whether generators take the push path with no ipc path beside it (whose buffer of a
    version the push otherwise sends)."""
    return "push" in expected_paths and "ipc" not in expected_paths and transport != "store"


def push_buffer_bytes(
    recipe: Any, transport: str, expected_paths: tuple[str, ...], push_buffer: str = "auto"
) -> float:
    """Bytes of the flat bf16 buffer trainer rank 0 keeps beside its shards where generators
    take their versions by push alone: each version goes out from it (the store path, and the
    push a group at a time, `weight_sync.push_buffer groups`, stream a block at a time
    instead). Beside the ipc path the push sends the ipc path's buffer of a version and keeps
    none of its own (runtime/weights/push.py, `lend_from`): nothing more (llama3.1-8b on four
    H200 ranks, ipc and push: 46.5 GB at a publish, one buffer; qwen3-8b on four, before the
    push borrowed it: 63.8 GB, two)."""
    if pushes_alone(transport, expected_paths) and push_buffer != "groups":
        return version_bytes(recipe)
    return 0.0


def _push_buffer(given: str, transport: str, expected_paths: tuple[str, ...]) -> str:
    """weight_sync.push_buffer as planned from `given` (the recipe's, or groups where a
    version's buffer would not fit): version or groups where generators take the push path
    alone (auto: version), none elsewhere (`check_push_buffer` refuses one set there)."""
    if pushes_alone(transport, expected_paths):
        return "version" if given == "auto" else given
    return "none"


def check_push_buffer(recipe: Any, sync: WeightSyncSettings) -> None:
    """A push_buffer the recipe sets where the chosen plan has no push alone would do
    nothing: one line."""
    given = recipe.weight_sync.push_buffer
    if given == "auto" or sync.push_buffer != "none":
        return
    why = (
        "the push path sends the ipc path's buffer of each version in this plan (a generator "
        "on trainer rank 0's GPU)"
        if "ipc" in sync.expected and "push" in sync.expected
        else "no generator takes the push path in this plan"
    )
    raise UserError(f"weight_sync.push_buffer {given}: {why}; leave it auto")


def push_receive_bytes(recipe: Any, expected_paths: tuple[str, ...]) -> float:
    """Bytes of the flat bf16 buffer a generator taking the push path receives each version
    into, on the first GPU of its group, beside vLLM (runtime/weights/push.py)."""
    return version_bytes(recipe) if "push" in expected_paths else 0.0


def _share_beside(accelerator: str, receive: float) -> float:
    """The largest share of the GPU (two decimals) vLLM may take and leave `receive` bytes and
    the process's overhead free."""
    total = ACCELERATOR_BYTES[accelerator]
    return math.floor((total - receive - RUNTIME_OVERHEAD_GB * GB) / total * 100) / 100


def _least_share(recipe: Any, accelerator: str) -> float:
    """The share of the GPU vLLM needs at the least: its weights, one group's KV cache and
    the runtime's overhead."""
    group = kv_gb(recipe, recipe.grpo.group_size)
    slots = lora_generator_bytes(recipe) / recipe.layout.generator.tp / GB
    need = generator_weights_gb(recipe) + slots + group + RUNTIME_OVERHEAD_GB
    return math.ceil(need * GB / ACCELERATOR_BYTES[accelerator] * 100) / 100


def ipc_buffer_held(recipe: Any, transport: str, expected_paths: tuple[str, ...]) -> float:
    """Bytes trainer rank 0 holds through a step beside its own: off-policy, a version's CUDA
    IPC buffer (bf16) lives on its GPU until every generator has loaded it, after the
    generation in flight, i.e. through the next step (measured, qwen3-8b on two H200s: 97.3 GB
    in a step, 16.4 of them the buffer)."""
    if "ipc" in expected_paths and transport != "store" and recipe.grpo.max_policy_age:
        return version_bytes(recipe)
    return 0.0


def _resident_bytes(recipe: Any, services: frozenset[str], kv: float | None) -> float:
    """Bytes the generator (bf16 weights, its fixed KV cache) and the reference (its estimate)
    keep on a GPU they share with the trainer."""
    from recipes.memory import estimate_memory

    total = 0.0
    if "generator" in services:
        total += shared_generator_gb(recipe, kv or 0.0) * GB
    if "reference" in services:
        total += estimate_memory(recipe)["reference"] * GB
    return total


def _trainer_plan(
    recipe: Any, accelerator: str, ranks: int, shared: bool, reserve: float = 0, held: float = 0
) -> tuple[int, bool, float | None, str | None]:
    """(tokens per micro-batch, activation checkpointing, estimated peak bytes, a note) for the
    trainer, honouring whichever of the two the recipe sets; `reserve` bytes of the GPU are
    kept for something else (the direct weight paths' buffer, services sharing the GPU) and
    `held` more by trainer rank 0 through a step (an off-policy CUDA IPC buffer). A
    `shared` trainer that fits nothing in what is left takes the smallest step: SHARED_TOKENS
    with checkpointing, and the note says so with the arithmetic; a knob the recipe sets that
    needs more than that step is refused with the arithmetic, as on a GPU of its own."""
    t = recipe.trainer
    given_tokens = None if t.tokens_per_micro_batch == "auto" else t.tokens_per_micro_batch
    given_ckpt = None if t.activation_checkpointing == "auto" else t.activation_checkpointing
    if accelerator == "cpu":  # small models: memory is no concern, recomputing would be
        return given_tokens or SHARED_TOKENS, bool(given_ckpt), None, None
    compiled = t.compile is not False  # "auto" compiles on a GPU
    arch, gpu = recipe.arch, ACCELERATOR_BYTES[accelerator] - reserve - held
    lora = recipe.model.lora
    fit = trainer_memory_plan(
        arch,
        ranks,
        gpu,
        tokens=given_tokens,
        checkpointing=given_ckpt,
        compiled=compiled,
        lora=lora,
    )
    if fit is not None:
        return (*fit, None)
    tokens = given_tokens or (SHARED_TOKENS if shared else PLAN_TOKENS[-1])
    ckpt = True if given_ckpt is None else given_ckpt
    fixed = trainer_fixed_bytes(arch, ranks, ckpt, lora)
    per_token = trainer_token_bytes(arch, ckpt, compiled)
    need = fixed + tokens * per_token
    if shared and given_tokens is None and given_ckpt is None:
        note = (
            f"estimated ~{need / GB:.0f} GB a rank, above the ~{PLAN_HEADROOM * gpu / GB:.0f} GB "
            "its memory plan keeps beside what shares its GPU: the smallest step"
        )
        return tokens, ckpt, None, note
    if given_tokens is None and given_ckpt is None:
        # Nothing fits the finer model though the coarse estimate let the recipe through:
        # the smallest micro-batch, recomputed, is the best chance.
        return tokens, ckpt, need, None
    smallest = trainer_fixed_bytes(arch, ranks, True, lora) + SHARED_TOKENS * trainer_token_bytes(
        arch, True, compiled
    )
    if shared and need <= smallest:
        # no more than the smallest step the plan itself falls back to
        return tokens, ckpt, None, None
    where = f"an {accelerator}"
    if reserve and shared:
        where = (
            f"what an {accelerator} leaves beside the {reserve / GB:.1f} GB that the services "
            "sharing it keep there"
        )
    elif reserve:
        where = f"what an {accelerator} leaves beside the {reserve / GB:.1f} GB weight-push buffer"
    if held:
        ipc = f"the {held / GB:.1f} GB CUDA IPC buffer of a version (held through a step)"
        where = f"{where} and {ipc}" if reserve else f"what an {accelerator} leaves beside {ipc}"
    raise DoesNotFit(
        f"trainer: {tokens} tokens per micro-batch "
        f"{'with' if ckpt else 'without'} activation checkpointing need ~{need / GB:.0f} GB "
        f"per trainer GPU ({fixed / GB:.0f} GB of weights, gradients and optimizer state on "
        f"{ranks} rank{'s' if ranks > 1 else ''} + {tokens} x {per_token / 1e6:.2f} MB), but "
        f"{PLAN_HEADROOM:.0%} of {where} is {PLAN_HEADROOM * gpu / GB:.0f} GB; lower "
        "trainer.tokens_per_micro_batch"
        + ("" if ckpt else " or set trainer.activation_checkpointing=true")
    )


def call_sequences(recipe: Any, replicas: int) -> int:
    """The sequences a generator replica samples in one generate call (a group at the least)."""
    g = recipe.grpo
    return max(
        math.ceil(g.prompts_per_step * g.group_size * g.steps_per_call / replicas), g.group_size
    )


def _kv_reserve_gb(recipe: Any, replicas: int) -> float:
    """The generator's KV reserve (recipes/memory.py) per GPU, in GB, rounded up to 0.5."""
    return math.ceil(kv_gb(recipe, call_sequences(recipe, replicas)) * 2) / 2


def _check_kv(recipe: Any, accelerator: str, kv_gb: float) -> None:
    weights = generator_weights_gb(recipe)
    need = shared_generator_gb(recipe, kv_gb)
    have = ACCELERATOR_BYTES[accelerator] / GB
    if need > have:
        raise DoesNotFit(
            f"generator.kv_cache_gb: {kv_gb:g} GB of KV cache + {weights:.0f} GB of bf16 "
            f"weights + {RUNTIME_OVERHEAD_GB:.0f} GB runtime = {need:.0f} GB per GPU, but an "
            f"{accelerator} has {have:.1f} GB; lower generator.kv_cache_gb"
        )
