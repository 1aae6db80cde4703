"""From a recipe and a GPU count to a plan: which service runs where, on how many GPUs.

The launcher (laptop) and the runtime (head node) both call `plan()` with the same recipe and GPU
count, so they agree on the layout without passing it around.

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

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from recipes.costs import predict_step, ranking_words
from recipes.errors import DoesNotFit, UserError
from recipes.memory import (
    ACCELERATOR_BYTES,
    ACCELERATOR_GB,
    GB,
    checkpoint_bytes,
    disk_errors,
    estimate_memory,
    export_host_bytes,
    host_plan,
    kv_gb,
    shared_generator_gb,
    trainer_publish_gb,
    trainer_step_bytes,
)
from recipes.placements import (
    Placement,
    Service,
    shared_services,
)
from recipes.schema import Recipe
from recipes.settings import (
    Settings,
    call_sequences,
    check_push_buffer,
    ipc_buffer_held,
    plan_settings,
    push_buffer_bytes,
)

GENERATOR_TO_TRAINER_GPUS = 2
# Plans stop here: 512 nodes of 8 GPUs (a count past this is a typo, not a cluster).
MAX_GPUS = 4096
MAX_GPUS_PER_NODE = 64


@dataclass(frozen=True)
class Candidate:
    """One layout the planner weighed: its predicted step, or why it does not fit."""

    share: str
    layout: str  # "generator 0, trainer 1-2, reference 2", say
    step_s: float | None = None
    samples_per_s_per_gpu: float | None = None
    bound_by: str = ""
    refused: str | None = None
    over_memory: bool = False  # refused for its memory arithmetic (recipes.errors.DoesNotFit)
    chosen: bool = False


@dataclass(frozen=True)
class Plan:
    """Where every service runs. `gpus_per_node` is the GPU count of each node in this plan."""

    recipe_name: str
    total_gpus: int
    gpus_per_node: int
    num_nodes: int
    cpu: bool
    generator_replicas: int
    generator_tp: int
    trainer_gpus: int
    reference_enabled: bool
    reference_gpus: int
    reward_procs: int
    placements: tuple[Placement, ...]
    memory: dict[str, float] = field(hash=False)
    idle_gpus: tuple[tuple[int, int], ...] = ()  # (node, local GPU index) given to no service
    accelerator: str = "H100"
    minimum_gpus: int = 0
    settings: Settings | None = field(default=None, hash=False, compare=True)
    # which services share GPUs: none, trainer_reference or all; and how (layout.sharing): in
    # turns, or with their calls at once
    share: str = "none"
    sharing: str = "turns"
    # under MPS, the services held below all of a GPU's SMs, with their share (%)
    mps_sm_percent: tuple[tuple[str, int], ...] = ()
    reference_host_gb: float | None = None  # a reference on the CPU: host memory it takes
    # a checkpoint write stages the trainer's shards (12 bytes a parameter) in node 0's memory
    checkpoint_host_gb: float | None = None
    # at the end trainer rank 0 writes the export from there, a file at a time (beside that copy)
    export_host_gb: float | None = None
    reference_step_tflop: float | None = None  # and the forward work it does a step
    disk: dict[str, float] = field(default_factory=dict, hash=False)  # GB a node, by use
    host: dict[str, float] = field(default_factory=dict, hash=False)  # node 0's memory, by use
    kv_note: str = ""  # a planned KV cache cut so that the trainer's step fits: what that means
    dedicated_gpus: int = 0  # the least GPUs with every service on GPUs of its own
    # the cost model's step time (recipes/costs.py) at `ranked_at`
    predicted_step_s: float | None = None
    ranked_at: str = ""  # the lengths layouts are weighed at, in words (costs.ranking_words)
    # ranked at the longest prompt: below which mean prompt length another layout comes first
    shorter_prompts: str = ""
    prediction: str = ""  # what bounds the step, and which measurements the speeds come from
    # every layout the planner weighed (layout.share auto), the chosen one included
    candidates: tuple[Candidate, ...] = field(default=(), hash=False, compare=False)
    # GB on each of the trainer's GPUs while it steps, by service ("node 0 GPU 1" -> ...)
    while_training_gb: dict[str, dict[str, float]] = field(
        default_factory=dict, hash=False, compare=False
    )

    def placements_of(self, service: Service) -> tuple[Placement, ...]:
        """The placements of one service, in replica order."""
        return tuple(p for p in self.placements if p.service == service)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field."""
        d = asdict(self)
        d["placements"] = [{**p, "gpus": list(p["gpus"])} for p in d["placements"]]
        d["idle_gpus"] = [list(g) for g in self.idle_gpus]
        d["settings"] = self.settings.to_dict() if self.settings else None
        return d

    def describe(self) -> str:
        """A table for people: service, replica, node, GPUs, parallelism, GB per GPU."""
        if self.cpu:
            nodes = f", {self.num_nodes} nodes" if self.num_nodes > 1 else ""
            head = f"{self.recipe_name} on CPU{nodes} (one process per row)"
        else:
            nodes = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''}"
            least = f"minimum {self.minimum_gpus} GPU{'' if self.minimum_gpus == 1 else 's'}"
            if self.minimum_gpus < self.dedicated_gpus:
                least += f" with services sharing, {self.dedicated_gpus} with GPUs of their own"
            per_node = f"{self.gpus_per_node} GPU{'' if self.gpus_per_node == 1 else 's'}"
            head = (
                f"{self.recipe_name} on {self.total_gpus} x {self.accelerator} "
                f"({nodes} x {per_node}; {least})"
            )
        rows = [("service", "replica", "node", "GPUs", "parallel", "GB/GPU")]
        for p in self.placements:
            mem = self.memory.get(p.service)
            rows.append(
                (
                    p.service,
                    str(p.replica),
                    str(p.node),
                    _gpu_list(p.gpus) if p.gpus else "cpu",
                    self._parallel(p),
                    f"{mem:.1f}" if mem is not None and p.gpus else "-",
                )
            )
        for node in sorted({n for n, _ in self.idle_gpus}):
            gpus = tuple(g for n, g in self.idle_gpus if n == node)
            rows.append(("idle", "-", str(node), _gpu_list(gpus), "-", "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        idle_nodes = [n for n in range(self.num_nodes) if self._idle_on(n) == self.gpus_per_node]
        if idle_nodes and not self.cpu:
            fewer = (self.num_nodes - len(idle_nodes)) * self.gpus_per_node
            lines.append(
                f"{_node_list(idle_nodes)} idle: the trainer stays on node 0, where checkpoints "
                f"are written, and the generator stops at twice its GPUs; --gpus {fewer} "
                "gives the same plan"
            )
        if self.reference_host_gb is not None:
            lines.append(
                f"reference on node 0's CPU (layout.reference.device: cpu): ~"
                f"{self.reference_host_gb:.0f} GB of host memory, float32, and a forward of "
                f"~{self.reference_step_tflop:.3g} TFLOP a step on its cores"
            )
        if self.checkpoint_host_gb is not None:
            lines.append(
                f"checkpoints: each write first copies the trainer's state to node 0's memory "
                f"(~{self.checkpoint_host_gb:.0f} GB"
                + ("" if self.cpu else ", pinned at start-up and reused by every write")
                + ") and goes to disk while training goes on"
            )
        if self.host:
            parts = ", ".join(f"{k} {v:.0f}" for k, v in self.host.items() if k != "total")
            lines.append(
                f"host memory: {self.host['total']:.0f} GB on node 0 ({parts}); the task asks "
                "for nodes with at least that much"
            )
        if self.disk:
            shown = {k: v for k, v in self.disk.items() if k not in ("total", "without a bucket")}
            parts = ", ".join(f"{k} {v:.0f}" for k, v in shown.items())
            short = self.disk.get("without a bucket")
            lines.append(
                f"disk: {self.disk['total']:.0f} GB a node ({parts}; resources.disk_gb)"
                if parts
                else f"disk: {self.disk['total']:.0f} GB a node (resources.disk_gb"
                + (
                    f"; enough only with --checkpoint-bucket: a node without one fills {short:.0f})"
                    if short
                    else ")"
                )
            )
        if self.share != "none" and not self.cpu:
            who, turns = SHARE_WORDS[self.share]
            how = turns
            if self.sharing == "mps":
                held = ", ".join(f"{name} {pct} %" for name, pct in self.mps_sm_percent)
                held = f"; SMs: {held} (layout.mps_sm_percent)" if held else ""
                how = MPS_WORDS.format(held=held)
            lines.append(f"layout.share {self.share}: {who}{how}; GB/GPU adds up per GPU")
        if self.predicted_step_s is not None:
            lines.append(
                f"predicted: {_seconds(self.predicted_step_s)} s a step at {self.ranked_at} "
                f"(bound by {self.prediction}); forgesky plan --explain weighs the layouts"
            )
        if self.shorter_prompts:
            lines.append(self.shorter_prompts)
        if not self.cpu:
            lines.append(
                f"GB/GPU is an estimate of what each service holds between steps "
                f"(recipes/memory.py), in GB of 10^9 bytes; an {self.accelerator} has "
                f"{ACCELERATOR_GB[self.accelerator]:.1f} GB"
            )
            lines += self._training_line()
        if self.settings is not None:
            where = "CPU" if self.cpu else self.accelerator
            lines.append(f"settings (* planned for {where}; set any with --set SECTION.KEY=VALUE):")
            lines += self.settings.describe(cpu=self.cpu, reference=self.reference_enabled)
            lines += [self.kv_note] if self.kv_note else []
            lines += self._tight_trainer()
        return "\n".join(lines)

    def _training_line(self) -> list[str]:
        """The fullest of the trainer's GPUs while it steps, by service."""
        if not self.while_training_gb:
            return []
        where, parts = max(self.while_training_gb.items(), key=lambda kv: sum(kv[1].values()))
        each = ", ".join(f"{service} {gb:.1f}" for service, gb in parts.items())
        device = ACCELERATOR_BYTES[self.accelerator] / GB
        return [
            f"while the trainer steps: ~{sum(parts.values()):.1f} GB on {where} ({each}; the "
            f"trainer with its activations) of an {self.accelerator}'s {device:.1f} GB"
        ]

    def _tight_trainer(self) -> list[str]:
        """A line when the trainer's memory plan found no micro-batch within its headroom and
        took the smallest: the run may still fit the device, but with less margin than planned."""
        from recipes.memory import ACCELERATOR_BYTES, PLAN_HEADROOM

        peak = self.settings.trainer.peak_gb if self.settings else None
        if self.cpu or peak is None:
            return []
        budget = PLAN_HEADROOM * ACCELERATOR_BYTES[self.accelerator] / GB
        if peak <= budget:
            return []
        larger = [
            a for a, size in ACCELERATOR_BYTES.items() if size > ACCELERATOR_BYTES[self.accelerator]
        ]
        # the trainer runs on node 0 alone: past its GPUs, only a larger GPU holds less a rank
        remedies = (
            ["more trainer GPUs on its node (layout.trainer.gpus)"]
            if self.trainer_gpus < self.gpus_per_node
            else []
        ) + ([f"a larger GPU (resources.accelerator: {' or '.join(larger)})"] if larger else [])
        return [
            f"note: the trainer's ~{peak:.0f} GB a rank is above the {budget:.0f} GB "
            f"({PLAN_HEADROOM:.0%} of an {self.accelerator}) its memory plan keeps to, at the "
            "smallest micro-batch"
            + (f"; each rank holds less with {' or with '.join(remedies)}" if remedies else "")
        ]

    def explain(self) -> str:
        """The layouts the planner weighed (layout.share auto): each one's predicted step and
        samples/s per GPU, or why it does not fit; the chosen one marked *."""
        if self.cpu:
            return "a CPU plan runs every service as its own process: there is no layout to weigh"
        if not self.candidates:
            return (
                f"layout.share {self.share} is set by the recipe: only that layout was planned "
                f"(predicted {self.predicted_step_s:.1f} s a step); layout.share auto weighs "
                "them all"
            )
        rows = [("", "share", "GPUs", "s/step", "samples/s/GPU", "bound by, or why not")]
        for c in self.candidates:
            rows.append(
                (
                    "*" if c.chosen else "",
                    c.share,
                    c.layout,
                    f"{c.step_s:.2f}" if c.step_s is not None else "-",
                    f"{c.samples_per_s_per_gpu:.2f}" if c.samples_per_s_per_gpu else "-",
                    (c.bound_by.split(";")[0] if c.refused is None else c.refused),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = [
            f"layouts weighed on {self.total_gpus} x {self.accelerator} (predicted at "
            f"{self.ranked_at}; recipes/costs.py):"
        ]
        for r in rows:
            cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
            lines.append("  ".join([*cells, r[-1]]).rstrip())
        basis = self.prediction.split("; speeds from ", 1)[-1]
        lines.append(f"speeds from {basis}")
        return "\n".join(lines)

    def _idle_on(self, node: int) -> int:
        return sum(1 for n, _ in self.idle_gpus if n == node)

    def _parallel(self, p: Placement) -> str:
        if self.cpu or p.service == "reward" or not p.gpus:
            return "-"
        if p.service == "generator":
            return f"TP{self.generator_tp}"
        if p.service == "reference":
            return f"FSDP{self.reference_gpus}"
        if p.service == "trainer":
            return f"FSDP{self.trainer_gpus}"
        return "-"


# (who shares, how: layout.sharing turns or mps)
SHARE_WORDS = {
    "trainer_reference": (
        "the generators have GPUs of their own, the trainer and the reference share the rest",
        " and take turns (score, train)",
    ),
    "all": ("every service shares every GPU", " and they take turns (sample, score, train)"),
}
MPS_WORDS = (
    ", their calls at once under NVIDIA MPS (layout.sharing mps{held}; the predicted step counts "
    "turns)"
)
# Ties go to the layout with fewer services sharing (fewer turns, fewer fixed caches).
SHARE_ORDER = ("none", "trainer_reference", "all")


def dedicated_gpus(recipe: Recipe) -> int:
    """GPUs the recipe's layout uses with every service on GPUs of its own (0 on CPU)."""
    if recipe.cpu:
        return 0
    lay = recipe.layout
    reference = lay.reference.gpus if lay.reference.on_gpu else 0
    return lay.generator.tp * lay.generator.replicas + reference + lay.trainer.gpus


def minimum_gpus(recipe: Recipe, accelerator: str | None = None) -> int:
    """The least GPUs `plan()` accepts (0 on CPU): with layout.share none the services' sum;
    otherwise the smallest count on one node where some layout the share allows fits memory
    (the sum where none does)."""
    dedicated = dedicated_gpus(recipe)
    if recipe.cpu or recipe.layout.share == "none":
        return dedicated
    accelerator = accelerator or recipe.resources.accelerator
    top = recipe.resources.gpus_per_node
    if recipe.layout.share != "all":
        top = min(top, dedicated)
    for n in range(_widest(recipe), top + 1):
        if any(c.refused is None for _, c in _candidates(recipe, n, n, accelerator)):
            return n
    return dedicated if recipe.layout.share == "auto" else _widest(recipe)


def _widest(recipe: Recipe) -> int:
    lay = recipe.layout
    reference = lay.reference.gpus if lay.reference.on_gpu else 0
    return max(lay.generator.tp, reference, 1)


# GPUs a node of the VM clouds comes with (1, 2, 4 or 8 of a kind); a Kubernetes cluster may
# grant any count.
SOLD_GPUS_PER_NODE = (1, 2, 4, 8)


def launch_gpus(recipe: Recipe) -> int:
    """The GPUs a launch asks for by default: the services' sum (layout.share all: the least
    that fits) rounded up to a count VM clouds sell (the planner gives the extra GPUs work),
    whole nodes past one node; 0 on CPU."""
    if recipe.cpu:
        return 0
    need = minimum_gpus(recipe) if recipe.layout.share == "all" else dedicated_gpus(recipe)
    gpn = recipe.resources.gpus_per_node
    if need > gpn:
        return -(-need // gpn) * gpn
    return next((n for n in SOLD_GPUS_PER_NODE if need <= n <= gpn), need)


def _seconds(value: float) -> str:
    """A step time as `plan` prints it: tenths, two significant digits below a second, and
    under 0.01 (what the plan keeps, in hundredths) as that."""
    if value >= 1:
        return f"{value:.1f}"
    return f"{value:.2g}" if value > 0 else "under 0.01"


def unsold_note(gpus: int, gpus_per_node: int) -> str | None:
    """A line for a GPU count per node that VM clouds do not sell, else None."""
    per_node = min(gpus, gpus_per_node)
    if per_node in SOLD_GPUS_PER_NODE:
        return None
    sold = ", ".join(map(str, SOLD_GPUS_PER_NODE[:-1])) + f" or {SOLD_GPUS_PER_NODE[-1]}"
    return (
        f"note: {per_node} GPUs a node: VM clouds sell {sold}, so only a Kubernetes cluster "
        "may grant this"
    )


def plan(
    recipe: Recipe,
    gpus: int,
    gpus_per_node: int | None = None,
    *,
    nodes: int | None = None,
    accelerator: str | None = None,
) -> Plan:
    """Place every service of `recipe` on `gpus` GPUs (nodes of at most `gpus_per_node`), and
    plan the services' settings for them (recipes/settings.py).

    `gpus_per_node` defaults to the recipe's resources.gpus_per_node. A CPU recipe takes 0 GPUs
    and `nodes` machines (default 1). For a GPU recipe the node count follows from `gpus`;
    `nodes`, if given, must be that count. `accelerator` is the GPU type the settings are
    planned for: the recipe's resources.accelerator unless given (the runtime passes the one
    it found), one of it and its alternatives.

    layout.share picks which services may share GPUs; with auto every layout that fits is
    predicted (recipes/costs.py) and the fastest is taken, the others kept as `candidates`.
    """
    gpn = recipe.resources.gpus_per_node if gpus_per_node is None else gpus_per_node
    if nodes is not None and nodes < 1:
        raise UserError(f"a run needs at least 1 node, got {nodes}")
    if gpus < 0:
        raise UserError(f"--gpus {gpus}: a GPU count is 0 or more")
    if gpus > MAX_GPUS:
        raise UserError(f"--gpus {gpus}: a plan takes at most {MAX_GPUS} GPUs")
    if gpn > MAX_GPUS_PER_NODE:
        raise UserError(f"{gpn} GPUs per node: a node has at most {MAX_GPUS_PER_NODE}")
    if nodes is not None and nodes > MAX_GPUS:
        raise UserError(f"{nodes} nodes: a plan takes at most {MAX_GPUS}")
    # a disk set by hand must hold what the run writes (with a checkpoint bucket, the least)
    for line in disk_errors(recipe, bucket=True):
        raise UserError(line)
    if recipe.cpu:
        if gpus != 0:
            raise UserError(
                f"{recipe.name} runs on CPU (resources.accelerator: cpu) and takes 0 GPUs, "
                f"got {gpus}; leave --gpus out (forgesky local {recipe.name} runs it here)"
            )
        cpu = _cpu_plan(recipe, nodes or 1)
        if cpu.settings is not None:
            check_push_buffer(recipe, cpu.settings.weight_sync)
        return cpu
    accepted = [recipe.resources.accelerator, *recipe.resources.alternatives]
    accelerator = accelerator or recipe.resources.accelerator
    if accelerator not in accepted:
        raise UserError(
            f"{recipe.name} runs on {' or '.join(accepted)} (resources.accelerator and "
            f"resources.alternatives), not {accelerator}"
        )
    if gpn < 1:
        raise UserError(f"gpus_per_node must be at least 1, got {gpn}")
    share = recipe.layout.share
    dedicated = dedicated_gpus(recipe)
    if gpus < 1 or (share == "none" and gpus < dedicated):
        raise UserError(_too_few(recipe, gpus, accelerator))
    num_nodes = -(-gpus // gpn)
    if num_nodes > 1 and gpus % gpn:
        options = [n for n in ((num_nodes - 1) * gpn, num_nodes * gpn) if n >= dedicated]
        raise UserError(
            f"{gpus} GPUs span {num_nodes} nodes, and a multi-node run uses whole nodes of "
            f"{gpn} GPUs: use {' or '.join(map(str, options))} GPUs"
        )
    if nodes is not None and nodes != num_nodes:
        raise UserError(
            f"{recipe.name} on {gpus} GPUs uses {num_nodes} node{'s' if num_nodes > 1 else ''} "
            f"of {min(gpus, gpn)} GPUs, not {nodes}: ask for {nodes * gpn} GPUs for {nodes} nodes"
        )
    per_node = gpus // num_nodes
    weighed = _candidates(recipe, gpus, per_node, accelerator)
    fits = [(p, c) for p, c in weighed if p is not None]
    if not fits:
        refusals = [c.refused for _, c in weighed if c.refused]
        if num_nodes == 1 and gpus < minimum_gpus(recipe, accelerator):
            # the memory arithmetic of a sharing layout refused at this count, if any
            why = next((c.refused for _, c in weighed if c.over_memory), None)
            why = why.removeprefix(f"{recipe.name}: ") if why else None
            raise UserError(_too_few(recipe, gpus, accelerator) + (f" ({why})" if why else ""))
        raise UserError(refusals[0] if refusals else _too_few(recipe, gpus, accelerator))
    best, _ = min(
        fits, key=lambda pc: (round(pc[1].step_s or 0.0, 3), SHARE_ORDER.index(pc[1].share))
    )
    candidates = tuple(dataclasses.replace(c, chosen=p is best) for p, c in weighed)
    _check_mps_shares(best)
    if best.settings is not None:
        check_push_buffer(recipe, best.settings.weight_sync)
    return dataclasses.replace(
        best,
        minimum_gpus=minimum_gpus(recipe, accelerator),
        candidates=candidates if share == "auto" else (),
        shorter_prompts=_shorter_prompts(recipe, best, [p for p, _ in fits])
        if share == "auto"
        else "",
    )


def _shorter_prompts(recipe: Recipe, best: Plan, fits: list[Plan]) -> str:
    """Where layouts were ranked at the longest prompt (no dataset.prompt_tokens_mean) and
    shorter prompts would put another layout first by at least HINT_MARGIN: the line that
    says below which mean prompt length, and the setting that ranks at the user's own."""
    others = [p for p in fits if p.share != best.share and p.settings is not None]
    if recipe.dataset.prompt_tokens_mean is not None or not others or best.settings is None:
        return ""
    longest = recipe.grpo.max_prompt_tokens
    step = max(1, longest // 64)
    for prompt in range(longest - step, 0, -step):
        first = _another_first(recipe, best, others, prompt)
        if first is not None:
            here, seconds, share = first
            return (
                f"prompts averaging {prompt} tokens or fewer put layout.share {share} "
                f"first by 10 % or more ({seconds:.2f} s a step against {here:.2f} at "
                f"{prompt}): --set dataset.prompt_tokens_mean=N (your prompts' mean, template "
                "and chat format included) ranks the layouts there"
            )
    return ""


def _another_first(
    recipe: Recipe,
    chosen: Plan,
    plans: list[Plan],
    prompt_tokens: float,
    response_tokens: float | None = None,
) -> tuple[float, float, str] | None:
    """At these mean lengths, where a plan of `plans` with another layout.share is predicted
    at least HINT_MARGIN faster than `chosen`: (chosen's seconds, the fastest such plan's,
    its layout.share); else None."""
    assert chosen.settings is not None

    def seconds(p: Plan) -> float:
        return predict_layout(
            recipe, chosen.accelerator, p.placements, p.settings, prompt_tokens, response_tokens
        ).seconds

    timed = [
        (seconds(p), p.share) for p in plans if p.share != chosen.share and p.settings is not None
    ]
    if not timed:
        return None
    here = seconds(chosen)
    fastest, share = min(timed)
    return (here, fastest, share) if fastest <= here * (1 - HINT_MARGIN) else None


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


# How much faster another layout must be predicted at a run's own lengths for the run to say so.
HINT_MARGIN = 0.10


def layout_hint(
    recipe: Recipe, chosen: Plan, prompt_tokens: float, response_tokens: float
) -> str | None:
    """Plans rank layouts (layout.share auto) at `recipes.costs.ranking_lengths`. At a run's
    own mean lengths another layout may be predicted faster: where one with another
    layout.share is by at least HINT_MARGIN, the line that says so, with the settings that
    take it; else None. (qwen3-1.7b on two H200s one step off-policy with 512-token
    completions: `all` 5.53 s against `trainer_reference` 6.21 s at 1024-token prompts, 3.50
    s against 2.93 s at 207; measured on one host at 207: 4.10 s and 3.16 s.)"""
    if chosen.cpu or recipe.layout.share != "auto" or chosen.settings is None:
        return None
    weighed = _candidates(recipe, chosen.total_gpus, chosen.gpus_per_node, chosen.accelerator)
    plans = [p for p, _ in weighed if p is not None]
    first = _another_first(recipe, chosen, plans, prompt_tokens, response_tokens)
    if first is None:
        return None
    here, seconds, share = first
    return (
        f"at this run's mean lengths ({prompt_tokens:.0f}-token prompts, "
        f"{response_tokens:.0f}-token completions) layout.share {share} is predicted at "
        f"{seconds:.2f} s a step, this plan ({chosen.share}) at {here:.2f} s; the plan ranked "
        f"layouts at {ranking_words(recipe)}: --set layout.share={share} takes it, or "
        f"--set dataset.prompt_tokens_mean={round(prompt_tokens)} lets the plan weigh them "
        "at this run's prompts"
    )


def sync_paths(sync: Any) -> tuple[str, ...]:
    """Each generator's weight path as the cost model names it: `push_groups` for the push a
    group at a time."""
    groups = sync.push_buffer == "groups"
    return tuple("push_groups" if p == "push" and groups else p for p in sync.expected)


def _check_mps_shares(chosen: Plan) -> None:
    """A share of the SMs is for a service that shares a GPU (an MPS client): one on GPUs of
    its own in the chosen layout would not use it."""
    shared = shared_services(chosen.placements)
    for name, _ in chosen.mps_sm_percent:
        if name not in shared:
            raise UserError(
                f"layout.mps_sm_percent.{name}: the {name} has GPUs of its own in this plan "
                f"(layout.share {chosen.share}); only services that share a GPU run under MPS"
            )


def _too_few(recipe: Recipe, gpus: int, accelerator: str) -> str:
    """The one line for a count below what fits: both minimums where sharing is allowed."""
    dedicated = dedicated_gpus(recipe)
    own = f"{dedicated} GPUs ({_breakdown(recipe)})"
    share = recipe.layout.share
    if share == "none":
        auto = recipe.model_copy(update={"layout": _with_share(recipe, "auto")})
        shared = minimum_gpus(auto, accelerator)
        more = (
            f"; {shared} with services sharing GPUs (layout.share auto)"
            if shared < dedicated
            else ""
        )
        return f"{recipe.name} needs at least {own}{more}; got {gpus}"
    least = minimum_gpus(recipe, accelerator)
    if least >= dedicated:
        return f"{recipe.name} needs at least {own}, also with services sharing GPUs on an {accelerator}; got {gpus}"
    return (
        f"{recipe.name} needs at least {least} GPU{'s' if least != 1 else ''} on an "
        f"{accelerator} with services sharing "
        f"them (layout.share {share}), {own} with a GPU for each service; got {gpus}"
    )


def _with_share(recipe: Recipe, share: str) -> Any:
    return recipe.layout.model_copy(update={"share": share})


def _candidates(
    recipe: Recipe, gpus: int, per_node: int, accelerator: str
) -> list[tuple[Plan | None, Candidate]]:
    """Every layout layout.share allows on `gpus` GPUs: its plan with a predicted step, or None
    and why it does not fit."""
    share = recipe.layout.share
    kinds = SHARE_ORDER if share == "auto" else (share,)
    num_nodes = -(-gpus // per_node)
    out: list[tuple[Plan | None, Candidate]] = []
    for kind in kinds:
        if kind == "none" and gpus < dedicated_gpus(recipe):
            out.append((None, Candidate(kind, "-", refused=_too_few_own(recipe, gpus))))
            continue
        if kind == "trainer_reference" and not recipe.layout.reference.on_gpu:
            continue  # no reference on a GPU: the same as none
        if kind != "none" and num_nodes > 1:
            out.append(
                (
                    None,
                    Candidate(
                        kind,
                        "-",
                        refused=f"{recipe.name}: layout.share {kind} runs on one node; use at most {per_node} GPUs",
                    ),
                )
            )
            continue
        builders = {
            "none": lambda: [_dedicated_plan(recipe, gpus, per_node, num_nodes, accelerator)],
            "trainer_reference": lambda: _trainer_reference_plans(recipe, gpus, accelerator),
            "all": lambda: _colocated_plans(recipe, gpus, accelerator),
        }
        try:
            plans = builders[kind]()
        except UserError as e:
            over = isinstance(e, DoesNotFit)
            out.append((None, Candidate(kind, "-", refused=str(e), over_memory=over)))
            continue
        for p in plans:
            out.append((p, _candidate(recipe, p)) if isinstance(p, Plan) else (None, p))
    return out


def _too_few_own(recipe: Recipe, gpus: int) -> str:
    return (
        f"{recipe.name} needs at least {dedicated_gpus(recipe)} GPUs with GPUs of their own "
        f"({_breakdown(recipe)}); got {gpus}"
    )


def _candidate(recipe: Recipe, p: Plan) -> Candidate:
    g = recipe.grpo
    g_per_step = 0.0
    if p.predicted_step_s:
        g_per_step = g.prompts_per_step * g.group_size / (p.predicted_step_s * p.total_gpus)
    return Candidate(
        share=p.share,
        layout=_layout_words(p.placements, p.num_nodes),
        step_s=p.predicted_step_s,
        samples_per_s_per_gpu=round(g_per_step, 2) if g_per_step else None,
        bound_by=p.prediction,
    )


def _layout_words(placements: tuple[Placement, ...], num_nodes: int) -> str:
    """ "generator 0, reference 2, trainer 1-2" (GPUs on node 0; node:GPUs past one node)."""
    parts = []
    for x in placements:
        if not x.gpus:
            continue
        name = x.service if x.service != "generator" else f"generator{x.replica}"
        where = _gpu_list(x.gpus) if num_nodes == 1 else f"{x.node}:{_gpu_list(x.gpus)}"
        parts.append(f"{name} {where}")
    return ", ".join(parts)


def _dedicated_plan(
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

    placements, used = _placements(packed, recipe.layout.reward.procs, _cpu_reference(recipe))
    idle = tuple((n, g) for n in range(num_nodes) for g in range(per_node) if (n, g) not in used)
    return _gpu_plan(
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


def _trainer_reference_plans(recipe: Recipe, gpus: int, accelerator: str) -> list[Plan]:
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
                    _gpu_plan(
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


def _gpu_plan(
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
            expected_paths=_expected_paths(recipe, placements),
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
            publish = trainer_publish_gb(recipe.arch, trainer_gpus) + flat
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
        kv_note = (
            f"note: the generator's KV cache is {cap:g} GB, cut from the {kv:g} GB that holds a "
            f"generate call's {call} sequences a replica at once, so that the trainer's step fits "
            f"beside it: vLLM holds ~{math.floor(cap / kv_gb(recipe, 1))} at a time and starts "
            "the others as those finish (the predicted step does not count the wait)"
        )
    _check_step_memory(recipe, accelerator, training, settings, share)
    if shared:
        _check_shared_memory(recipe, accelerator, memory, settings, placements, rank0_only, share)
    estimate = predict_layout(recipe, accelerator, placements, settings)
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
        accelerator=accelerator,
        settings=settings,
        share=share,
        sharing=recipe.layout.sharing,
        mps_sm_percent=recipe.layout.mps_sm_percent.limited(),
        while_training_gb=training,
        reference_host_gb=_reference_host_gb(recipe),
        checkpoint_host_gb=round(checkpoint_bytes(recipe.arch) / GB, 1),
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
        recipe.arch, t.ranks, t.tokens_per_micro_batch, t.activation_checkpointing, t.compile
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
    from recipes.memory import disk_plan

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
    if not _cpu_reference(recipe):
        return None
    g = recipe.grpo
    tokens = g.prompts_per_step * g.group_size * (g.max_prompt_tokens + g.max_response_tokens)
    return round(2 * recipe.arch.params * tokens / 1e12, 3)


def _reference_host_gb(recipe: Recipe) -> float | None:
    from recipes.memory import reference_host_gb

    return reference_host_gb(recipe) if _cpu_reference(recipe) else None


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


def _colocated_plans(recipe: Recipe, gpus: int, accelerator: str) -> list[Plan | Candidate]:
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
                words = _layout_words(_colocated_placements(spanned, gpus, replicas), 1)
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
    if lay.reference.enabled:
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
            f"{recipe.name}: layout.share all needs at least {_widest(recipe)} GPUs (its "
            f"widest service's); got {gpus}"
        )
    placements_t = _colocated_placements(recipe, gpus, replicas)
    used = {g for p in placements_t for g in p.gpus}
    return _gpu_plan(
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


def _generator_gb(recipe: Recipe, settings: Settings, memory: dict[str, float]) -> float:
    """GB a generator replica holds on each of its GPUs: its bf16 weights with the fixed KV
    cache its settings give (where it shares a GPU), else its whole estimate."""
    kv = settings.generator.kv_cache_gb
    return memory["generator"] if kv is None else round(shared_generator_gb(recipe, kv), 1)


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


def _expected_paths(recipe: Recipe, placements: tuple[Placement, ...]) -> tuple[str, ...]:
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


def _cpu_plan(recipe: Recipe, nodes: int) -> Plan:
    lay = recipe.layout
    units: list[tuple[Service, int]] = [("generator", r) for r in range(lay.generator.replicas)]
    if lay.reference.enabled:
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
        expected_paths=_expected_paths(recipe, tuple(placements)),
    )
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


def _cpu_reference(recipe: Recipe) -> bool:
    return recipe.layout.reference.enabled and not recipe.layout.reference.on_gpu


def _breakdown(recipe: Recipe) -> str:
    lay = recipe.layout
    g, t = lay.generator, lay.trainer
    parts = [f"generator {g.tp * g.replicas} = TP{g.tp}×{g.replicas}"]
    if _cpu_reference(recipe):
        parts.append("reference on CPU")
    elif lay.reference.enabled:
        n = lay.reference.gpus
        parts.append(f"reference {n}" + (f" = FSDP{n}" if n > 1 else ""))
    parts.append(f"trainer {t.gpus} = FSDP{t.gpus}")
    return ", ".join(parts)


def _node_list(nodes: list[int]) -> str:
    """ "node 3", "nodes 3-5"."""
    if len(nodes) == 1:
        return f"node {nodes[0]}"
    return f"nodes {_gpu_list(tuple(nodes))}"


def _gpu_list(gpus: tuple[int, ...]) -> str:
    """ "0-3" for a contiguous run, "0,2,5" otherwise."""
    if len(gpus) > 1 and list(gpus) == list(range(gpus[0], gpus[-1] + 1)):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(map(str, gpus))
