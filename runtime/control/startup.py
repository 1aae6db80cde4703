"""A run's start-up on the controller's node: the other nodes attached, the weight store, every
service's procs pinned to the plan's GPUs, their actors built and set up."""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from typing import Any

from recipes.memory import checkpoint_bytes
from recipes.placements import shared_services

# Imported with this module, before the run says it starts its services: an import holds the
# event loop, and a Ctrl-C during start-up is handled at the loop's next turn.
from runtime.actors import GeneratorActor, ReferenceActor, RewardActor, TrainerActor
from runtime.control.checkpoint import approx_size
from runtime.control.config import RunConfig
from runtime.control.services import Services
from runtime.control.watchdog import Watchdog
from runtime.procs.lifecycle import RunLifecycle
from runtime.procs.mesh import available_cores
from runtime.procs.mps import SM_PERCENT_ENV, uses_mps
from runtime.procs.nodes import attach_nodes
from runtime.procs.spawn import spawn_service
from runtime.weights import store as weights

# The allocator of a GPU service that shares its GPUs: segments that grow and shrink, so one
# service's freed memory serves the next (fixed segments fragment across their turns).
SHARED_GPU_ALLOC_CONF = "expandable_segments:True"


def _start_mps(life: RunLifecycle) -> dict[str, str]:
    """layout.sharing mps: a control daemon of the run's own, stopped after the procs (which
    are registered later, so stopped first); its clients' environment."""
    from runtime.procs.mps import QUIT_TIMEOUT_S, start_daemon

    daemon = start_daemon()

    async def stop() -> None:
        await asyncio.to_thread(daemon.stop)

    # its own limit first (the quit, then the wait), so that its own error is what is said
    life.register("mps daemon", stop, timeout=2 * QUIT_TIMEOUT_S + 5)
    print(f"NVIDIA MPS daemon started for the services sharing a GPU ({daemon.folder})", flush=True)
    return daemon.env


def _placements(plan: Any, service: str) -> list[Any]:
    return [p for p in plan.placements if p.service == service]


def trainer_ranks(trainer_gpus: tuple[int, ...], ranks: int) -> list[tuple[int, ...]]:
    """The GPUs of each trainer proc (one FSDP rank each): one proc per trainer GPU; on CPU,
    `ranks` procs (the plan's trainer.ranks: gloo ranks)."""
    if not trainer_gpus:
        return [()] * ranks
    return [(g,) for g in trainer_gpus]


def group_env(ranks: int) -> dict[str, str]:
    """Rendezvous of one service's ranks (the trainer's, the reference's; torch.distributed
    env://). The plan keeps each on one node, so its ranks meet on the loopback at a port
    free here."""
    from runtime.backends.fsdp_trainer import WORLD_ENV

    if ranks == 1:
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {WORLD_ENV: str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


async def start_services(life: RunLifecycle, config: RunConfig) -> Services:
    """Every service of the plan, started, set up and supervised by `life`: the other nodes
    attached, the weight store, then all procs at once, their actors, and their set-up."""
    plan, recipe = config.plan, config.recipe
    life.places.update(_places(plan))  # a failure's line says where the service runs
    # First, so that at shutdown the other nodes are let go last.
    hosts = await attach_nodes(life, config.cluster, join_timeout=config.join_timeout)
    store = await life.call("weights", weights.start_store())
    life.register("weight store", lambda: weights.stop_store(store))

    gens = _placements(plan, "generator")
    refs = _placements(plan, "reference") if plan.reference_enabled else []
    trainers = _placements(plan, "trainer")
    settings = plan.settings
    ranks = trainer_ranks(tuple(g for p in trainers for g in p.gpus), settings.trainer.ranks)
    # the reference likewise: one proc per GPU, sharded over them (gloo ranks on CPU)
    ref_ranks = trainer_ranks(refs[0].gpus, settings.reference.ranks) if refs else []
    # Services that share a GPU take turns: the caching allocator grows and shrinks segments
    # so one's freed memory serves the next (fixed segments fragment across the turns).
    shared = shared_services(plan.placements)
    mps_env = _start_mps(life) if uses_mps(plan) else {}
    sm_percent = dict(plan.mps_sm_percent)

    def gpu_env(service: str, env: dict[str, str] | None = None) -> dict[str, str]:
        extra = dict(env or {})
        if service in shared:
            extra.setdefault("PYTORCH_CUDA_ALLOC_CONF", SHARED_GPU_ALLOC_CONF)
            if mps_env:  # layout.sharing mps: the services sharing a GPU are clients
                extra.update(mps_env)
                if service in sm_percent:  # layout.mps_sm_percent: read as CUDA starts
                    extra[SM_PERCENT_ENV] = str(sm_percent[service])
        return extra

    # a failure one trainer or reference proc reports names that proc's GPU
    if trainers:
        life.proc_places["trainer"] = [_on(trainers[0].node, gpus) for gpus in ranks]
    if refs:
        life.proc_places["reference"] = [_on(refs[0].node, gpus) for gpus in ref_ranks]

    # CPU threads: every service proc computes at once (rollouts overlap training)
    busy = len(ranks) + len(gens) + len(ref_ranks) + plan.reward_procs
    threads = max(1, available_cores() // busy)

    began = time.perf_counter()
    reward_host = hosts.host_of("reward", _placements(plan, "reward"))
    # All procs start at once: each spends seconds importing torch and the model code.
    spawns = [
        spawn_service(
            life,
            "trainer",
            len(ranks),
            gpus=ranks,
            env=gpu_env("trainer", group_env(len(ranks))),
            threads=threads,
            host=hosts.host_of("trainer", trainers),
        ),
        spawn_service(life, "reward", plan.reward_procs, threads=1, host=reward_host),
        *(
            spawn_service(
                life,
                f"generator{p.replica}",
                1,
                gpus=[p.gpus],
                env=gpu_env("generator"),
                threads=threads,
                host=hosts.host(p.node),
            )
            for p in gens
        ),
        *(
            spawn_service(
                life,
                "reference",
                len(ref_ranks),
                gpus=ref_ranks,
                env=gpu_env("reference", group_env(len(ref_ranks))),
                threads=threads,
                host=hosts.host(refs[0].node),
            )
            for _ in refs[:1]
        ),
    ]
    from runtime.environments.nodes import start_environment_nodes

    # the CPU nodes' environment hosts start beside the services (their workers with the run's
    # episodes, runtime/control/controller.py)
    meshes, env_nodes = await asyncio.gather(
        asyncio.gather(*spawns), start_environment_nodes(life, hosts, plan)
    )
    trainer = meshes[0].spawn_actor(TrainerActor)
    reward = meshes[1].spawn_actor(RewardActor)
    generators = [m.spawn_actor(GeneratorActor) for m in meshes[2 : 2 + len(gens)]]
    reference = meshes[2 + len(gens)].spawn_actor(ReferenceActor) if refs else None
    # Stopped before the procs (resources stop newest first).
    for i, g in enumerate(generators):
        life.register(
            f"generator{i} engine", functools.partial(g.close.call_one), mesh=meshes[2 + i]
        )

    rewards = [r.model_dump() for r in recipe.dataset.rewards]
    # A compiled trainer makes its graphs while the generators start, rather than in the first
    # step; the reference after it (they may share a GPU, and take turns on it in the steps).
    trainer_warm = asyncio.Event()
    # the made-up rows: the recipe's widest
    width = recipe.grpo.max_prompt_tokens + recipe.grpo.max_response_tokens

    async def trainer_up() -> Any:
        try:
            # every trainer rank joins the group
            setup = trainer.setup.call(recipe, settings, store)
            answer = await _ready("trainer", life.call("trainer", setup), began)
            await _warm_up("trainer", life.call("trainer", trainer.warm_up.call(width)))
        finally:
            trainer_warm.set()  # the reference waits for it, whatever became of it
        return answer

    async def reference_up(reference: Any) -> Any:
        # every reference rank joins its group
        setup = reference.setup.call(recipe, settings)
        answer = await _ready("reference", life.call("reference", setup), began)
        await trainer_warm.wait()
        await _warm_up("reference", life.call("reference", reference.warm_up.call(width)))
        return answer

    setups = [
        trainer_up(),
        *(
            _ready(
                f"generator{p.replica}",
                life.call(f"generator{p.replica}", g.setup.call_one(recipe, settings, store)),
                began,
            )
            for p, g in zip(gens, generators, strict=True)
        ),
        _ready("reward", life.call("reward", reward.setup.call(rewards)), began),
    ]
    if reference is not None:
        setups.append(reference_up(reference))
    answers = await asyncio.gather(*setups)
    info = next(value for _, value in answers[0].items())
    # the generators' tokenizer pads batches (the controller loads none of its own)
    pad_id = answers[1]["pad_id"]
    # FSDPTrainer (a GPU, or several CPU ranks) reports its memory plan; the CPU TitanTrainer
    # runs on one rank and has none.
    if info.get("tokens_per_micro_batch"):
        ac = "on" if info["activation_checkpointing"] else "off"
        ranks_text = f"{info['ranks']} rank" + ("s" if info["ranks"] > 1 else "")
        print(
            f"trainer: {info['backend']} on {ranks_text}, "
            f"{info['tokens_per_micro_batch']} tokens per micro-batch, "
            f"activation checkpointing {ac}"
            + (", the weights gathered once a step" if info.get("gather_once") else ""),
            flush=True,
        )
    _say_sm_shares(answers, gens, reference is not None)
    if info.get("checkpoint_copy"):
        size = approx_size(checkpoint_bytes(recipe.arch, recipe.model.lora))
        print(
            f"trainer: its host copy for checkpoints ({size} over its ranks, pinned) was started "
            "while the other services started",
            flush=True,
        )
    return Services(
        life,
        trainer,
        generators,
        reference,
        reward,
        plan.reward_procs,
        pad_id,
        watchdog=Watchdog(recipe.watchdog, places=_places(plan)),
        reference_in_trainer=plan.reference_in_trainer,
        environment_nodes=env_nodes,
    )


def _say_sm_shares(answers: list[Any], gens: list[Any], with_reference: bool) -> None:
    """layout.mps_sm_percent: the share of the SMs each MPS client found set as it started."""
    said = {"trainer": next(value for _, value in answers[0].items())}
    said |= {f"generator{p.replica}": a for p, a in zip(gens, answers[1:], strict=False)}
    if with_reference:
        said["reference"] = next(value for _, value in answers[-1].items())
    shares = {name: answer.get("mps_sm_percent") for name, answer in said.items()}
    if any(shares.values()):
        words = ", ".join(f"{name} {pct or 100} %" for name, pct in shares.items())
        print(
            f"SMs each service may use under NVIDIA MPS (layout.mps_sm_percent): {words}",
            flush=True,
        )


async def _warm_up(service: str, call: Any) -> None:
    """The service's graphs compiled ahead of its first step, said in a line where there were
    any (the answer of its first rank: every rank compiles the same graphs)."""
    answers = await call
    line = warm_up_line(service, next((value for _, value in answers.items()), None))
    if line:
        print(line, flush=True)


def warm_up_line(service: str, done: dict[str, float] | None) -> str | None:
    """What a service's `warm_up` answer says: the graphs it compiled before its first step and
    how long that took, that it found no room to, or nothing (nothing compiled, or nothing to
    compile)."""
    if not done:
        return None
    if done.get("out_of_memory"):
        return (
            f"  {service}: no room on its GPU beside the generator's start to compile ahead; "
            "its first step compiles"
        )
    if not done["graphs"]:
        return None
    return (
        f"  {service}: {done['graphs']:.0f} graphs compiled before its first step "
        f"({done['seconds']:.1f} s)"
    )


async def _ready(service: str, setup: Any, began: float) -> Any:
    """`setup`'s answer, with a line when it comes: which services are up while the slowest
    (a vLLM engine compiling, a large model loading) still starts."""
    answer = await setup
    print(f"  {service} ready ({time.perf_counter() - began:.1f} s)", flush=True)
    return answer


def _places(plan: Any) -> dict[str, str]:
    """Where each GPU service runs, in words (node and GPUs), for the failure and watchdog
    lines."""
    places = {}
    for p in plan.placements:
        if p.service == "reward":
            continue
        name = f"generator{p.replica}" if p.service == "generator" else p.service
        places[name] = _on(p.node, p.gpus)
    return places


def _on(node: int, gpus: tuple[int, ...] | list[int]) -> str:
    """`node 0 GPU 1`, `node 0 GPUs 0,1` or `node 0 CPU`."""
    if not gpus:
        return f"node {node} CPU"
    return f"node {node} GPU{'s' if len(gpus) > 1 else ''} {','.join(map(str, gpus))}"


async def start_trainer_alone(
    life: RunLifecycle, recipe: Any, plan: Any, settings: Any
) -> Services:
    """An SFT run's one service: the trainer's ranks (one proc per trainer GPU; on CPU the
    planned gloo ranks) on this node, set up and supervised by `life`; no weight store, no
    generator, no reference, no reward. `settings`: an object whose `trainer` is the planned
    recipes.settings.TrainerSettings."""
    life.places.update(_places(plan))
    trainers = _placements(plan, "trainer")
    ranks = trainer_ranks(tuple(g for p in trainers for g in p.gpus), settings.trainer.ranks)
    life.proc_places["trainer"] = [_on(trainers[0].node, gpus) for gpus in ranks]
    began = time.perf_counter()
    mesh = await spawn_service(
        life,
        "trainer",
        len(ranks),
        gpus=ranks,
        env=group_env(len(ranks)),
        threads=max(1, available_cores() // len(ranks)),
    )
    trainer = mesh.spawn_actor(TrainerActor)
    # every rank joins the group
    setup = life.call("trainer", trainer.setup.call(recipe, settings, None))
    answers = await _ready("trainer", setup, began)
    info = next(value for _, value in answers.items())
    ranks_text = f"{info['ranks']} rank" + ("s" if info["ranks"] > 1 else "")
    once = ", the weights gathered once a step" if info.get("gather_once") else ""
    print(f"trainer: {info['backend']} on {ranks_text} ({info['device']}){once}", flush=True)
    return Services(
        life,
        trainer,
        [],
        None,
        None,
        0,
        0,
        watchdog=Watchdog(recipe.watchdog, places=_places(plan)),
    )
