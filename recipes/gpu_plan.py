"""One GPU layout's plan: its placements with the services' settings planned for them, checked
to fit memory GPU by GPU, and the step the cost model predicts.

Every GPU layout (recipes/layouts.py) ends here: the settings come from recipes/settings.py,
the GB a service holds from recipes/memory.py, the step time from recipes/costs.py. A layout
whose fullest GPU is over the device is refused with `DoesNotFit`, which names that GPU and
what would make room.
"""

from __future__ import annotations

import math
from typing import Any

from recipes.costs import predict_step, ranking_words
from recipes.environment import env_words, node_env_plan, planned_node
from recipes.errors import DoesNotFit
from recipes.memory import (
    ACCELERATOR_BYTES,
    ACCELERATOR_GB,
    GB,
    checkpoint_bytes,
    disk_plan,
    estimate_memory,
    export_host_bytes,
    host_plan,
    kv_gb,
    reference_host_gb,
    shared_generator_gb,
    trainer_publish_gb,
    trainer_step_bytes,
)
from recipes.placements import Placement, shared_services
from recipes.plan_words import Plan, kv_cut_note, lanes_kv_note, lora_words
from recipes.schema import Recipe
from recipes.settings import (
    Settings,
    call_sequences,
    ipc_buffer_held,
    plan_settings,
    push_buffer_bytes,
)


def dedicated_gpus(recipe: Recipe) -> int:
    """GPUs the recipe's layout uses with every service on GPUs of its own (0 on CPU)."""
    if recipe.cpu:
        return 0
    lay = recipe.layout
    if recipe.kind == "sft":  # the trainer alone
        return lay.trainer.gpus
    reference = lay.reference.gpus if lay.reference.on_gpu else 0
    return lay.generator.tp * lay.generator.replicas + reference + lay.trainer.gpus


def gpu_plan(
    recipe: Recipe,
    accelerator: str,
    placements: tuple[Placement, ...],
    *,
    gpus: int,
    per_node: int,
    num_nodes: int,
    replicas: int,
    trainer_gpus: int,
    idle: tuple[tuple[int, int], ...],
    share: str,
) -> Plan:
    """The Plan of GPU placements: the services' settings and memory planned for them, checked
    to fit each GPU together where services share one, and the step the cost model predicts."""
    lay = recipe.layout
    shared = shared_services(placements)

    def planned(kv_cap_gb: float | None = None) -> tuple[Settings, dict[str, float], float]:
        settings = plan_settings(
            recipe,
            accelerator=accelerator,
            shared=shared,
            beside_trainer=_beside(placements, "trainer"),
            trainer_gpus=trainer_gpus,
            generator_replicas=replicas,
            expected_paths=expected_paths(recipe, placements),
            kv_cap_gb=kv_cap_gb,
        )
        memory = estimate_memory(recipe, generator_replicas=replicas, trainer_gpus=trainer_gpus)
        # a generator sharing its GPUs holds the fixed KV cache its settings give
        memory["generator"] = _generator_gb(recipe, settings, memory)
        sync = settings.weight_sync
        step = memory["trainer"]  # every rank's
        # trainer rank 0 alone keeps the push path's buffer (where a generator takes that path)
        flat = push_buffer_bytes(recipe, sync.transport, sync.expected, sync.push_buffer) / GB
        memory["trainer"] = round(step + flat, 1)
        if "ipc" in sync.expected:
            # the ipc path's buffer of a version, on trainer rank 0's GPU from a publish until
            # the generators have loaded it: a peak of its own, beside a step's (a push to
            # other generators sends from it)
            publish = trainer_publish_gb(recipe.arch, trainer_gpus, recipe.model.lora) + flat
            memory["trainer"] = max(memory["trainer"], round(publish, 1))
        rank0_only = memory["trainer"] - step  # GB rank 0 holds beyond the other ranks
        return settings, memory, rank0_only

    settings, memory, rank0_only = planned()
    # the trainer's GPUs at its step peak first: the fullest of them in most layouts
    training = while_training(recipe, settings, placements, memory)
    # a planned KV cache that would leave the step no room: the largest that does, down to
    # half of it (vLLM then samples a call's sequences in waves, which the predicted step does
    # not count); smaller, the layout is refused
    kv = settings.generator.kv_cache_gb
    cap = _kv_that_fits(recipe, settings, training, ACCELERATOR_BYTES[accelerator] / GB)
    kv_note = ""
    if "generator.kv_cache_gb" in settings.planned and cap and kv and cap >= kv / 2:
        settings, memory, rank0_only = planned(cap)
        training = while_training(recipe, settings, placements, memory)
        call = call_sequences(recipe, replicas)
        kv_note = kv_cut_note(cap, kv, call, math.floor(cap / kv_gb(recipe, 1)))
    kv_note = "\n".join(n for n in (kv_note, _lanes_note(recipe, settings, replicas)) if n)
    _check_step_memory(recipe, accelerator, training, settings, share)
    if shared:
        _check_shared_memory(recipe, accelerator, memory, settings, placements, rank0_only, share)
    estimate = predict_layout(recipe, accelerator, placements, settings)
    vcpus, node = planned_node(accelerator, per_node)
    environment = node_env_plan(recipe, False, placements, replicas, vcpus, node)
    return Plan(
        recipe_name=recipe.name,
        total_gpus=gpus,
        gpus_per_node=per_node,
        num_nodes=num_nodes,
        cpu=False,
        generator_replicas=replicas,
        generator_tp=lay.generator.tp,
        trainer_gpus=trainer_gpus,
        reference_enabled=lay.reference.enabled,
        reference_gpus=lay.reference.gpus,
        reward_procs=lay.reward.procs,
        placements=placements,
        memory=memory,
        idle_gpus=idle,
        reference_in_trainer=lay.reference.in_trainer,
        lora=lora_words(recipe),
        env=env_words(recipe, environment.workers if environment else None),
        environment=environment,
        accelerator=accelerator,
        settings=settings,
        share=share,
        sharing=recipe.layout.sharing,
        mps_sm_percent=recipe.layout.mps_sm_percent.limited(),
        while_training_gb=training,
        reference_host_gb=_reference_host_gb(recipe),
        checkpoint_host_gb=round(checkpoint_bytes(recipe.arch, recipe.model.lora) / GB, 1),
        export_host_gb=round(export_host_bytes(recipe) / GB, 1),
        reference_step_tflop=_reference_step_tflop(recipe),
        disk=_disk(recipe),
        host=host_plan(recipe, min(gpus, per_node), _reference_host_gb(recipe)),
        kv_note=kv_note,
        dedicated_gpus=dedicated_gpus(recipe),
        predicted_step_s=round(estimate.seconds, 2),
        ranked_at=ranking_words(recipe),
        prediction=f"{estimate.bound_by}; speeds from {estimate.basis}",
    )


def while_training(
    recipe: Recipe, settings: Settings, placements: tuple[Placement, ...], memory: dict[str, float]
) -> dict[str, dict[str, float]]:
    """GB on each of the trainer's GPUs while it steps, by service: a rank's step estimate
    (recipes.memory.trainer_step_bytes at the planned micro-batch; rank 0 also the buffer a
    version goes out from, where it outlives the publish) and what the services sharing the
    GPU hold there (their GB/GPU)."""
    t, sync = settings.trainer, settings.weight_sync
    step = trainer_step_bytes(
        recipe.arch,
        t.ranks,
        t.tokens_per_micro_batch,
        t.activation_checkpointing,
        t.compile,
        recipe.model.lora,
        gathered=t.gather_once,
    )
    rank0 = ipc_buffer_held(recipe, sync.transport, sync.expected) + push_buffer_bytes(
        recipe, sync.transport, sync.expected, sync.push_buffer
    )
    trainer = next(p for p in placements if p.service == "trainer")
    out: dict[str, dict[str, float]] = {}
    for gpu in trainer.gpus:
        parts = {"trainer": round((step + (rank0 if gpu == trainer.gpus[0] else 0)) / GB, 1)}
        for p in placements:
            if p.service != "trainer" and p.node == trainer.node and gpu in p.gpus:
                parts[p.service] = round(parts.get(p.service, 0.0) + memory[p.service], 1)
        out[f"node {trainer.node} GPU {gpu}"] = parts
    return out


def predict_layout(
    recipe: Recipe,
    accelerator: str,
    placements: tuple[Placement, ...],
    settings: Settings,
    prompt_tokens: float | None = None,
    response_tokens: float | None = None,
) -> Any:
    """The cost model's step (recipes.costs.StepEstimate) for `placements` with their planned
    `settings`: at `recipes.costs.ranking_lengths` unless given."""
    return predict_step(
        recipe,
        accelerator,
        placements,
        trainer_checkpointing=settings.trainer.activation_checkpointing,
        transports=sync_paths(settings.weight_sync),
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
    )


def sync_paths(sync: Any) -> tuple[str, ...]:
    """Each generator's weight path as the cost model names it: `push_groups` for the push a
    group at a time."""
    groups = sync.push_buffer == "groups"
    return tuple("push_groups" if p == "push" and groups else p for p in sync.expected)


def expected_paths(recipe: Recipe, placements: tuple[Placement, ...]) -> tuple[str, ...]:
    """The weight path each generator replica should take (runtime/weights/transport.choose
    decides at start from where the procs really are)."""
    mode = recipe.weight_sync.transport
    trainer = next(p for p in placements if p.service == "trainer")
    paths = []
    for p in placements:
        if p.service != "generator":
            continue
        if mode == "store" or not p.gpus:
            paths.append("store" if mode != "push" else "push")
        elif trainer.gpus and p.node == trainer.node and p.gpus[0] == trainer.gpus[0]:
            # the version's buffer is on trainer rank 0's GPU, and a generator's procs see
            # only their own GPUs: one that starts on another trainer GPU gets it pushed
            paths.append("ipc")
        else:
            paths.append("push")
    return tuple(paths)


def _check_step_memory(
    recipe: Recipe,
    accelerator: str,
    training: dict[str, dict[str, float]],
    settings: Settings,
    share: str,
) -> None:
    """The fullest of the trainer's GPUs while it steps (`while_training`: its step at the
    planned micro-batch, rank 0's version buffer, the services sharing the GPU) must fit what
    CUDA reports for the device."""
    where, parts = max(training.items(), key=lambda kv: sum(kv[1].values()))
    total, device = sum(parts.values()), ACCELERATOR_BYTES[accelerator] / GB
    if total > device:
        shown = " + ".join(f"{k} {v:.1f}" for k, v in parts.items())
        remedy = "use more GPUs" + (
            "" if share == "none" else " or give the services GPUs of their own (layout.share none)"
        )
        raise DoesNotFit(
            f"{recipe.name}: layout.share {share}: while the trainer steps, {where} would hold "
            f"{shown} = {total:.1f} GB, over an {accelerator}'s {device:.1f} GB; {remedy}"
            + _smaller_kv(recipe, settings, training, device)
        )


def _check_shared_memory(
    recipe: Recipe,
    accelerator: str,
    memory: dict[str, float],
    settings: Settings,
    placements: tuple[Placement, ...],
    rank0_only: float,
    share: str,
) -> None:
    """Services that share a GPU must fit it together, GPU by GPU: the trainer's estimate
    (trainer rank 0, on the trainer's first GPU, less `rank0_only` on the others), the
    generator's bf16 weights with its fixed KV cache (its whole estimate where it has the GPU
    to itself), and the reference's."""
    generator = memory["generator"]
    trainer = next(p for p in placements if p.service == "trainer")
    per_gpu: dict[tuple[int, int], dict[str, float]] = {}
    for p in placements:
        for gpu in p.gpus:
            if p.service == "trainer":
                gb = memory["trainer"] - (rank0_only if gpu != trainer.gpus[0] else 0.0)
            else:
                gb = generator if p.service == "generator" else memory.get(p.service, 0.0)
            per_gpu.setdefault((p.node, gpu), {})[p.service] = gb
    capacity = ACCELERATOR_GB[accelerator]
    (_, gpu), parts = max(per_gpu.items(), key=lambda item: sum(item[1].values()))
    total = sum(parts.values())
    if total > capacity:
        shown = " + ".join(f"{k} {v:.0f}" for k, v in parts.items())
        raise DoesNotFit(
            f"{recipe.name}: layout.share {share} puts {shown} = {total:.0f} GB on GPU {gpu}, "
            f"an {accelerator} of {capacity:.1f} GB; use more GPUs or give the services GPUs "
            "of their own (layout.share none)" + _smaller_kv(recipe, settings, per_gpu, capacity)
        )


def _kv_that_fits(
    recipe: Recipe,
    settings: Settings,
    per_gpu: dict[Any, dict[str, float]],
    capacity: float,
) -> float | None:
    """Where some GPU is over `capacity` and the generator's KV cache is what does not fit,
    the largest cache (to 0.5 GB, a group's at the least) with which every GPU would: vLLM
    then samples in waves. None where every GPU fits, or one without the generator is over."""
    kv = settings.generator.kv_cache_gb
    if kv is None:
        return None
    over = {gpu: sum(parts.values()) - capacity for gpu, parts in per_gpu.items()}
    if max(over.values()) <= 0:
        return None
    if any(excess > 0 and "generator" not in per_gpu[gpu] for gpu, excess in over.items()):
        return None
    least = kv_gb(recipe, recipe.grpo.group_size)  # a replica holds one group at the least
    fits = math.floor((kv - max(over.values())) * 2) / 2
    return fits if fits >= max(least, 0.5) else None


def _smaller_kv(
    recipe: Recipe,
    settings: Settings,
    per_gpu: dict[Any, dict[str, float]],
    capacity: float,
) -> str:
    """The advice a refusal ends with where a smaller KV cache would fit (`_kv_that_fits`)."""
    kv = settings.generator.kv_cache_gb
    fits = _kv_that_fits(recipe, settings, per_gpu, capacity)
    if kv is None or fits is None:
        return ""
    why = (
        f"planned {kv:g} GB to hold a generate call's sequences at once"
        if "generator.kv_cache_gb" in settings.planned
        else f"set to {kv:g} GB"
    )
    return (
        f", or a KV cache of at most {fits:g} GB (--set generator.kv_cache_gb={fits:g}; "
        f"{why}; a smaller cache makes vLLM sample a call's sequences in waves)"
    )


def _generator_gb(recipe: Recipe, settings: Settings, memory: dict[str, float]) -> float:
    """GB a generator replica holds on each of its GPUs: its bf16 weights with the fixed KV
    cache its settings give (where it shares a GPU), else its whole estimate."""
    kv = settings.generator.kv_cache_gb
    return memory["generator"] if kv is None else round(shared_generator_gb(recipe, kv), 1)


def _beside(placements: tuple[Placement, ...], service: str) -> frozenset[str]:
    """The other GPU services on one GPU or more of `service`'s."""
    mine = {(p.node, g) for p in placements if p.service == service for g in p.gpus}
    return frozenset(
        p.service
        for p in placements
        if p.service != service and any((p.node, g) in mine for g in p.gpus)
    )


def _disk(recipe: Recipe) -> dict[str, float]:
    """The node disk: the recipe's, or what the run writes without a checkpoint bucket."""
    given = recipe.resources.disk_gb
    if given == "auto":
        return disk_plan(recipe)
    # plan() has refused less than a node fills with a bucket; without one it may need more
    need = disk_plan(recipe)
    least = math.ceil(sum(v for k, v in need.items() if k != "total"))
    return {"total": float(given)} | ({"without a bucket": float(least)} if given < least else {})


def _reference_step_tflop(recipe: Recipe) -> float | None:
    """2 FLOPs a parameter a token over a step's sequences (prompt and response at their
    limits): the reference's forward work."""
    if not recipe.layout.reference.on_cpu:
        return None
    g = recipe.grpo
    tokens = g.prompts_per_step * g.group_size * (g.max_prompt_tokens + g.max_response_tokens)
    return round(2 * recipe.arch.params * tokens / 1e12, 3)


def _reference_host_gb(recipe: Recipe) -> float | None:
    return reference_host_gb(recipe) if recipe.layout.reference.on_cpu else None


def _lanes_note(recipe: Recipe, settings: Any, replicas: int) -> str:
    """Where a sized KV cache (services sharing a GPU) holds fewer sequences than a replica's
    lanes keep open, the note that says so (episodes of one lane then lose their prefixes)."""
    env, kv = recipe.env, settings.generator.kv_cache_gb
    if env is None or env.batches_in_flight < 2 or not isinstance(kv, (int, float)):
        return ""
    open_episodes = env.batches_in_flight * call_sequences(recipe, replicas)
    held = math.floor(kv / kv_gb(recipe, 1))
    return lanes_kv_note(env.batches_in_flight, open_episodes, held) if held < open_episodes else ""
