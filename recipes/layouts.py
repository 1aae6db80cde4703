"""The layouts: which service goes on which GPUs of which node, for each layout.share.

none (`dedicated_plan`) gives every service GPUs of its own, over as many nodes as the count
asks; trainer_reference and all (`trainer_reference_plans`, `colocated_plans`) put services on
shared GPUs of one node; `cpu_plan` runs each service as its own process. Each layout's
placements become a plan in recipes/gpu_plan.py; recipes/planner.py weighs them.

Extra GPUs. The recipe's layout is the minimum; GPUs beyond it are handed out one unit at a time
by a single rule:

1. while the generator holds fewer than twice the trainer's GPUs, add a generator replica
   (generator.tp GPUs) or, if a replica no longer fits, widen the trainer by one FSDP rank
   (one GPU);
2. once the generator holds twice the trainer's GPUs, widen the trainer by one rank;
3. stop when the step a rule asks for does not fit (the trainer grows only within node 0, see
   Nodes); the GPUs left are listed as idle.

Why 2:1: in GRPO each step first samples group_size responses per prompt, one token at a time
(memory-bandwidth bound), then trains once on the finished batch (one compute-bound forward and
backward). Sampling ~1k-token responses takes about twice as long as training on them, so the
generator gets up to twice the trainer's GPUs, and never more: a generator that outruns the
trainer only produces samples that go stale (max_policy_age). The rule also makes the plan
monotonic: more GPUs never mean fewer generator replicas. (The trainer may shrink by a rank when
one more GPU lets a generator replica take the GPUs a trainer rank would have used.)

Nodes. Up to gpus_per_node GPUs is one node of that many GPUs. Beyond it, a run uses whole nodes
(a multiple of gpus_per_node), the shape clouds sell and SkyPilot provisions (every node of a
cluster gets the same accelerators). The trainer always runs on node 0, all its GPUs there: node 0
runs the controller, and a checkpoint's files and its COMMITTED marker are then written on one
node (runtime/control/checkpoint.py). On a cloud the checkpoint dir is a bucket mounted on each node with
asynchronous uploads; with the trainer elsewhere, node 0's marker could be uploaded before the
trainer's files, and a "committed" checkpoint could lack them. So the trainer never grows past
node 0, and a recipe whose trainer needs more GPUs than a node has does not plan. The other
tensor-parallel groups (a generator replica, the reference) never cross a node either; they go to
nodes largest first, each into the first node with room left after the trainer (with
power-of-two group sizes this finds a placement whenever one exists); within a node GPUs are
numbered in service order. Reward procs run on CPU on node 0, next to the controller.

CPU recipes run on one machine unless `nodes` asks for more (a CPU cluster, and the multi-node
tests): the trainer then runs on node 0, for the same reason, and the generator replicas and the
reference go round-robin over the nodes starting at node 1, so node 0, which also runs the
controller, the weight store and the reward procs, gets one of them last.
"""

from __future__ import annotations

from recipes.environment import env_words, node_env_plan, planned_node
from recipes.errors import DoesNotFit, UserError
from recipes.gpu_plan import expected_paths, gpu_plan
from recipes.memory import estimate_memory
from recipes.placements import Placement, Service
from recipes.plan_words import Candidate, Plan, layout_words, lora_words
from recipes.schema import Recipe
from recipes.settings import plan_settings

# extra GPUs go to the generator until it holds this many times the trainer's (see above)
GENERATOR_TO_TRAINER_GPUS = 2


def widest(recipe: Recipe) -> int:
    """The GPUs of the recipe's widest group that must sit on one node (a generator replica,
    the reference): the least any layout takes."""
    lay = recipe.layout
    reference = lay.reference.gpus if lay.reference.on_gpu else 0
    return max(lay.generator.tp, reference, 1)


def dedicated_plan(
    recipe: Recipe, gpus: int, per_node: int, num_nodes: int, accelerator: str
) -> Plan:
    """layout.share none: every service on GPUs of its own; extra GPUs by the module's rule."""
    lay = recipe.layout
    gen_tp = lay.generator.tp
    ref_gpus = lay.reference.gpus if lay.reference.on_gpu else 0
    replicas, trainer_gpus = lay.generator.replicas, lay.trainer.gpus

    def packing(replicas: int, trainer_gpus: int) -> list[tuple[Service, int, int, int]] | None:
        groups = _groups(replicas, gen_tp, ref_gpus, trainer_gpus)
        if sum(g[2] for g in groups) > gpus:
            return None
        return _pack(groups, num_nodes, per_node)

    packed = packing(replicas, trainer_gpus)
    if packed is None and per_node < lay.trainer.gpus:
        raise UserError(
            f"{recipe.name}: the trainer's {lay.trainer.gpus} GPUs must all sit on node 0 (the "
            f"controller's node, where checkpoints are written), and a node here has {per_node}; "
            f"set layout.trainer.gpus to at most {per_node} or use nodes of at least "
            f"{lay.trainer.gpus} GPUs"
        )
    if packed is None:
        largest = max(gen_tp, ref_gpus)
        raise UserError(
            f"{recipe.name}: cannot place its services on {num_nodes} nodes of {per_node} GPUs "
            f"with the trainer on node 0 and no tensor-parallel group split (largest TP "
            f"{largest}); use more GPUs per node"
        )
    while True:
        attempts = [(replicas, trainer_gpus + 1)]
        if gen_tp * replicas < GENERATOR_TO_TRAINER_GPUS * trainer_gpus:
            attempts.insert(0, (replicas + 1, trainer_gpus))
        for r, n in attempts:
            if (grown := packing(r, n)) is not None:
                replicas, trainer_gpus, packed = r, n, grown
                break
        else:
            break

    placements, used = _placements(
        packed, recipe.layout.reward.procs, recipe.layout.reference.on_cpu
    )
    idle = tuple((n, g) for n in range(num_nodes) for g in range(per_node) if (n, g) not in used)
    return gpu_plan(
        recipe,
        accelerator,
        placements,
        gpus=gpus,
        per_node=per_node,
        num_nodes=num_nodes,
        replicas=replicas,
        trainer_gpus=trainer_gpus,
        idle=idle,
        share="none",
    )


def trainer_reference_plans(recipe: Recipe, gpus: int, accelerator: str) -> list[Plan]:
    """layout.share trainer_reference on one node: r generator replicas on the first GPUs,
    the trainer sharded over the rest, the reference on the last of those; one plan for every
    r that fits (the cost model picks)."""
    lay = recipe.layout
    tp, ref = lay.generator.tp, lay.reference.gpus
    plans: list[Plan] = []
    refusals: list[UserError] = []
    for replicas in range(1, gpus // tp + 1):
        first = replicas * tp
        rest = tuple(range(first, gpus))
        if len(rest) < max(ref, 1):
            break
        generators = [
            Placement("generator", r, 0, tuple(range(r * tp, (r + 1) * tp)))
            for r in range(replicas)
        ]
        for n in _reference_spans(recipe, len(rest)):
            placements = [
                *generators,
                Placement("reference", 0, 0, rest[-n:]),
                Placement("trainer", 0, 0, rest),
                *(Placement("reward", r, 0, ()) for r in range(lay.reward.procs)),
            ]
            try:
                plans.append(
                    gpu_plan(
                        _with_reference_gpus(recipe, n),
                        accelerator,
                        tuple(placements),
                        gpus=gpus,
                        per_node=gpus,
                        num_nodes=1,
                        replicas=replicas,
                        trainer_gpus=len(rest),
                        idle=(),
                        share="trainer_reference",
                    )
                )
            except UserError as e:
                refusals.append(e)
    if not plans:
        if refusals:
            raise refusals[0]  # as raised: a memory refusal stays one (DoesNotFit)
        raise UserError(
            f"{recipe.name}: layout.share trainer_reference needs a GPU for a generator "
            f"replica (TP{tp}) and {max(ref, 1)} for the trainer and the reference; got {gpus}"
        )
    return plans


def _reference_spans(recipe: Recipe, room: int) -> tuple[int, ...]:
    """The reference's GPU counts a sharing layout weighs where `room` GPUs could hold it:
    layout.reference.gpus, and with layout.reference.spread every one of them (its rows split
    over more ranks: a shorter turn, a smaller shard on each GPU), unless the recipe sets
    reference.ranks."""
    ref = recipe.layout.reference
    if not ref.spread or not ref.on_gpu or room <= ref.gpus or recipe.reference.ranks != "auto":
        return (ref.gpus,)
    return (ref.gpus, room)


def _with_reference_gpus(recipe: Recipe, n: int) -> Recipe:
    if n == recipe.layout.reference.gpus:
        return recipe
    ref = recipe.layout.reference.model_copy(update={"gpus": n})
    return recipe.model_copy(update={"layout": recipe.layout.model_copy(update={"reference": ref})})


def colocated_plans(recipe: Recipe, gpus: int, accelerator: str) -> list[Plan | Candidate]:
    """layout.share all, one plan for each GPU count of the reference that fits (the cost
    model picks), each with as many generator replicas as fit: a replica on every
    generator.tp GPUs, else fewer, which leaves room on the GPUs without one. Where fewer
    replicas fit, the refused layouts with more come along as candidates (`--explain`)."""
    plans: list[Plan] = []
    refusals: list[UserError] = []
    refused: list[Candidate] = []
    for n in _reference_spans(recipe, gpus):
        spanned = _with_reference_gpus(recipe, n)
        for replicas in range(max(gpus // recipe.layout.generator.tp, 1), 0, -1):
            try:
                plans.append(_colocated_plan(spanned, gpus, accelerator, replicas))
                break
            except DoesNotFit as e:
                refusals.append(e)
                words = layout_words(_colocated_placements(spanned, gpus, replicas), 1)
                refused.append(Candidate("all", words, refused=str(e), over_memory=True))
            except UserError as e:
                refusals.append(e)
                break
    if not plans:
        raise refusals[0]  # as raised: a memory refusal stays one (DoesNotFit)
    return [*plans, *refused]


def _colocated_placements(recipe: Recipe, gpus: int, replicas: int) -> tuple[Placement, ...]:
    """layout.share all's placements on one node (see `_colocated_plan`)."""
    lay = recipe.layout
    gen_tp = lay.generator.tp
    placements = [
        Placement("generator", r, 0, tuple(range(r * gen_tp, (r + 1) * gen_tp)))
        for r in range(replicas)
    ]
    if lay.reference.enabled and not lay.reference.in_trainer:
        # the last GPUs: GPU 0 holds trainer rank 0, which alone stages each published version
        on = tuple(range(gpus - lay.reference.gpus, gpus)) if lay.reference.on_gpu else ()
        placements.append(Placement("reference", 0, 0, on))
    placements.append(Placement("trainer", 0, 0, tuple(range(gpus))))
    placements += [Placement("reward", r, 0, ()) for r in range(lay.reward.procs)]
    return tuple(placements)


def _colocated_plan(recipe: Recipe, gpus: int, accelerator: str, replicas: int) -> Plan:
    """layout.share all: on one node, the trainer shards over every GPU (FSDP), the generator's
    `replicas` take generator.tp GPUs each from the first, the reference sits on the last
    reference.gpus; every GPU's services take turns, and must fit it together."""
    lay = recipe.layout
    gen_tp = lay.generator.tp
    if (
        replicas < 1
        or replicas * gen_tp > gpus
        or (lay.reference.on_gpu and lay.reference.gpus > gpus)
    ):
        raise UserError(
            f"{recipe.name}: layout.share all needs at least {widest(recipe)} GPUs (its "
            f"widest service's); got {gpus}"
        )
    placements_t = _colocated_placements(recipe, gpus, replicas)
    used = {g for p in placements_t for g in p.gpus}
    return gpu_plan(
        recipe,
        accelerator,
        placements_t,
        gpus=gpus,
        per_node=gpus,
        num_nodes=1,
        replicas=replicas,
        trainer_gpus=gpus,
        idle=tuple((0, g) for g in range(gpus) if g not in used),
        share="all",
    )


def cpu_plan(recipe: Recipe, nodes: int) -> Plan:
    lay = recipe.layout
    units: list[tuple[Service, int]] = [("generator", r) for r in range(lay.generator.replicas)]
    if lay.reference.enabled and not lay.reference.in_trainer:  # in the trainer: its procs
        units.append(("reference", 0))
    placements = [Placement(s, r, (i + 1) % nodes, ()) for i, (s, r) in enumerate(units)]
    placements.append(Placement("trainer", 0, 0, ()))  # node 0: see the module docstring
    placements += [Placement("reward", r, 0, ()) for r in range(lay.reward.procs)]
    settings = plan_settings(
        recipe,
        accelerator="cpu",
        shared=frozenset(),
        trainer_gpus=0,
        generator_replicas=lay.generator.replicas,
        expected_paths=expected_paths(recipe, tuple(placements)),
    )
    vcpus, node = planned_node("cpu", 0)
    environment = node_env_plan(recipe, True, placements, lay.generator.replicas, vcpus, node)
    return Plan(
        recipe_name=recipe.name,
        total_gpus=0,
        gpus_per_node=0,
        num_nodes=nodes,
        cpu=True,
        generator_replicas=lay.generator.replicas,
        generator_tp=1,
        trainer_gpus=0,
        reference_enabled=lay.reference.enabled,
        reference_gpus=1,
        reward_procs=lay.reward.procs,
        placements=tuple(placements),
        memory=estimate_memory(recipe),
        reference_in_trainer=lay.reference.in_trainer,
        lora=lora_words(recipe),
        env=env_words(recipe, environment.workers if environment else None),
        environment=environment,
        accelerator="cpu",
        minimum_gpus=0,
        settings=settings,
        sharing=recipe.layout.sharing,
        mps_sm_percent=recipe.layout.mps_sm_percent.limited(),
    )


def _groups(
    replicas: int, gen_tp: int, ref_tp: int, trainer_gpus: int
) -> list[tuple[Service, int, int]]:
    """(service, index, size) of every group that must sit on one node, in service order; the
    trainer is one group."""
    groups: list[tuple[Service, int, int]] = [("generator", r, gen_tp) for r in range(replicas)]
    if ref_tp:
        groups.append(("reference", 0, ref_tp))
    groups.append(("trainer", 0, trainer_gpus))
    return groups


def _pack(
    groups: list[tuple[Service, int, int]], num_nodes: int, per_node: int
) -> list[tuple[Service, int, int, int]] | None:
    """(service, index, size, node) per group: the trainer on node 0, then the others largest
    first into the first node with room; None if some group fits no node."""
    free = [per_node] * num_nodes
    node_of: dict[int, int] = {}
    trainer = next(i for i, g in enumerate(groups) if g[0] == "trainer")
    others = sorted((i for i in range(len(groups)) if i != trainer), key=lambda i: -groups[i][2])
    for i in [trainer, *others]:
        candidates = [0] if i == trainer else range(num_nodes)
        node = next((n for n in candidates if free[n] >= groups[i][2]), None)
        if node is None:
            return None
        free[node] -= groups[i][2]
        node_of[i] = node
    return [(*g, node_of[i]) for i, g in enumerate(groups)]


def _placements(
    packed: list[tuple[Service, int, int, int]], reward_procs: int, cpu_reference: bool = False
) -> tuple[tuple[Placement, ...], set[tuple[int, int]]]:
    next_gpu: dict[int, int] = {}
    placements: list[Placement] = []
    for service, index, size, node in packed:
        start = next_gpu.get(node, 0)
        next_gpu[node] = start + size
        placements.append(Placement(service, index, node, tuple(range(start, start + size))))
    if cpu_reference:  # on node 0's CPU, beside the controller and the reward procs
        placements.append(Placement("reference", 0, 0, ()))
    placements += [Placement("reward", r, 0, ()) for r in range(reward_procs)]
    used = {(p.node, g) for p in placements for g in p.gpus}
    return tuple(placements), used
