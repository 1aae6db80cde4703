"""The plan in words: the `Plan` record and what `forgesky plan` prints of it.

`Plan.describe` is the table and the lines under it (memory, disk, sharing, the predicted step,
the settings), `Plan.explain` the layouts weighed; the notes and hints a plan or a run adds
(a KV cache cut to fit, a layout that shorter prompts would rank first) are worded here too. A
new line of the plan goes here, with the field it reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from recipes.environment import EnvPlan
from recipes.lora import adapter_params, targets_words
from recipes.memory import ACCELERATOR_BYTES, ACCELERATOR_GB, GB, PLAN_HEADROOM
from recipes.placements import Placement, Service
from recipes.schema import Recipe
from recipes.settings import Settings


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
    # a planned KV cache cut so that the trainer's step fits, or too small for every lane's
    # episodes: what that means (lines)
    kv_note: str = ""
    dedicated_gpus: int = 0  # the least GPUs with every service on GPUs of its own
    # the cost model's step time (recipes/costs.py) at `ranked_at`
    predicted_step_s: float | None = None
    ranked_at: str = ""  # the lengths layouts are weighed at, in words (costs.ranking_words)
    # ranked at the longest prompt: below which mean prompt length another layout comes first
    shorter_prompts: str = ""
    # where the staleness bound sets the step: what one version staler would take (a line)
    staler_policy: str = ""
    # off-policy where on-policy is predicted about as fast on this layout: that line
    fresher_policy: str = ""
    prediction: str = ""  # what bounds the step, and which measurements the speeds come from
    # every layout the planner weighed (layout.share auto), the chosen one included
    candidates: tuple[Candidate, ...] = field(default=(), hash=False, compare=False)
    # GB on each of the trainer's GPUs while it steps, by service ("node 0 GPU 1" -> ...)
    while_training_gb: dict[str, dict[str, float]] = field(
        default_factory=dict, hash=False, compare=False
    )
    # a LoRA run: the reference is scored in the trainer's processes (no placement of its
    # own), and the line under the table that says what trains (`lora_words`)
    reference_in_trainer: bool = False
    lora: str = ""
    # a multi-turn run: the line on its environment (recipes/environment.py `env_words`)
    env: str = ""
    # and where its environment workers go, for the cores they need (`env_plan`)
    environment: EnvPlan | None = field(default=None, hash=False, compare=False)
    # an SFT run on GPUs: its trainer's and sft section's settings (recipes.sft.settings_data)
    sft_settings: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def env_nodes(self) -> int:
        """CPU-only nodes for the environment workers, after the run's own (env.cpu_nodes)."""
        return self.environment.cpu_nodes if self.environment else 0

    def placements_of(self, service: Service) -> tuple[Placement, ...]:
        """The placements of one service, in replica order."""
        return tuple(p for p in self.placements if p.service == service)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field."""
        d = asdict(self)
        d["placements"] = [{**p, "gpus": list(p["gpus"])} for p in d["placements"]]
        d["idle_gpus"] = [list(g) for g in self.idle_gpus]
        d["settings"] = self.settings.to_dict() if self.settings else None
        if not self.lora:  # a run that trains every parameter: as before LoRA was planned
            del d["reference_in_trainer"], d["lora"]
        if not self.env:  # a single-turn run
            del d["env"], d["environment"]
        else:
            d["environment"] = self.environment.to_dict() if self.environment else None
        if self.sft_settings is None:
            del d["sft_settings"]
        return d

    def describe(self) -> str:
        """A table for people (service, replica, node, GPUs, parallelism, GB per GPU) and the
        lines under it: host memory and disk, the sharing and the predicted step, GPU memory,
        the settings."""
        return "\n".join(
            [
                *self._table(),
                *([self.lora] if self.lora else []),
                *([self.env] if self.env else []),
                *([self.environment.words()] if self.environment else []),
                *self._host_lines(),
                *self._step_lines(),
                *self._gpu_memory_lines(),
                *self._settings_lines(),
            ]
        )

    def _table(self) -> list[str]:
        """The head line, a row per placement and per node's idle GPUs, and whole idle nodes."""
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
        return lines

    def _host_lines(self) -> list[str]:
        """Node 0's memory beyond the GPUs (a CPU reference, checkpoint staging) and the disk."""
        lines: list[str] = []
        # a LoRA run's checkpoint and export are the adapter's, well under a GB for most
        gb = _fine_gb if self.lora else _whole_gb
        if self.reference_host_gb is not None:
            lines.append(
                f"reference on node 0's CPU (layout.reference.device: cpu): ~"
                f"{self.reference_host_gb:.0f} GB of host memory, float32, and a forward of "
                f"~{self.reference_step_tflop:.3g} TFLOP a step on its cores"
            )
        if self.checkpoint_host_gb is not None:
            lines.append(
                f"checkpoints: each write first copies the trainer's state to node 0's memory "
                f"(~{gb(self.checkpoint_host_gb)} GB"
                + ("" if self.cpu else ", pinned at start-up and reused by every write")
                + ") and goes to disk while training goes on"
            )
        if self.host:
            parts = ", ".join(f"{k} {gb(v)}" for k, v in self.host.items() if k != "total")
            lines.append(
                f"host memory: {self.host['total']:.0f} GB on node 0 ({parts}); the task asks "
                "for nodes with at least that much"
            )
        if self.disk:
            shown = {k: v for k, v in self.disk.items() if k not in ("total", "without a bucket")}
            parts = ", ".join(f"{k} {gb(v)}" for k, v in shown.items())
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
        return lines

    def _step_lines(self) -> list[str]:
        """How services share GPUs, and the step the cost model predicts for this layout."""
        lines: list[str] = []
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
                f"(bound by {self.prediction})"
                + ("; forgesky plan --explain weighs the layouts" if self.candidates else "")
            )
        if self.shorter_prompts:
            lines.append(self.shorter_prompts)
        if self.staler_policy:
            lines.append(self.staler_policy)
        if self.fresher_policy:
            lines.append(self.fresher_policy)
        return lines

    def _gpu_memory_lines(self) -> list[str]:
        """What GB/GPU means, and the fullest trainer GPU while it steps."""
        if self.cpu:
            return []
        return [
            f"GB/GPU is an estimate of what each service holds between steps "
            f"(recipes/memory.py), in GB of 10^9 bytes; an {self.accelerator} has "
            f"{ACCELERATOR_GB[self.accelerator]:.1f} GB",
            *self._training_line(),
        ]

    def _settings_lines(self) -> list[str]:
        """The services' settings, planned ones marked, with the notes on what was planned."""
        where = "CPU" if self.cpu else self.accelerator
        if self.settings is None:
            if not self.sft_settings:
                return []
            head = f"settings (* planned for {where}; set any with --set SECTION.KEY=VALUE):"
            return [head, *sft_lines(self.sft_settings)]
        return [
            f"settings (* planned for {where}; set any with --set SECTION.KEY=VALUE):",
            *self.settings.describe(
                cpu=self.cpu,
                reference=self.reference_enabled,
                reference_in_trainer=self.reference_in_trainer,
            ),
            *([self.kv_note] if self.kv_note else []),
            *self._tight_trainer(),
        ]

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
        if self.generator_replicas == 0:  # SFT: the trainer alone (recipes/sft.py)
            return "an SFT plan has one layout: the trainer on every GPU it is given"
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


def _seconds(value: float) -> str:
    """A step time as `plan` prints it: tenths, two significant digits below a second, and
    under 0.01 (what the plan keeps, in hundredths) as that."""
    if value >= 1:
        return f"{value:.1f}"
    return f"{value:.2g}" if value > 0 else "under 0.01"


def layout_words(placements: tuple[Placement, ...], num_nodes: int) -> str:
    """ "generator 0, reference 2, trainer 1-2" (GPUs on node 0; node:GPUs past one node)."""
    parts = []
    for x in placements:
        if not x.gpus:
            continue
        name = x.service if x.service != "generator" else f"generator{x.replica}"
        where = _gpu_list(x.gpus) if num_nodes == 1 else f"{x.node}:{_gpu_list(x.gpus)}"
        parts.append(f"{name} {where}")
    return ", ".join(parts)


def breakdown(recipe: Recipe) -> str:
    """ "generator 2 = TP1×2, reference 1, trainer 1 = FSDP1": the recipe's layout, service by
    service, where each has GPUs of its own."""
    lay = recipe.layout
    g, t = lay.generator, lay.trainer
    parts = [f"generator {g.tp * g.replicas} = TP{g.tp}×{g.replicas}"]
    if recipe.layout.reference.on_cpu:
        parts.append("reference on CPU")
    elif lay.reference.in_trainer:
        parts.append("reference in trainer")
    elif lay.reference.enabled:
        n = lay.reference.gpus
        parts.append(f"reference {n}" + (f" = FSDP{n}" if n > 1 else ""))
    parts.append(f"trainer {t.gpus} = FSDP{t.gpus}")
    return ", ".join(parts)


def lora_words(recipe: Recipe) -> str:
    """The plan's line on a LoRA run (the adapter, its share of the model, where the reference
    is scored); "" for a run that trains every parameter."""
    lora = recipe.model.lora
    if lora is None:
        return ""
    arch = recipe.arch
    trained = adapter_params(arch, lora)
    alpha = f"alpha {lora.scaling_alpha:g}" + (" (2 x rank)" if lora.alpha is None else "")
    line = (
        f"LoRA rank {lora.rank}, {alpha} on {targets_words(lora)}: {_count(trained)} "
        f"trainable ({100 * trained / arch.params:.3g} % of {_count(arch.params)}), the base "
        "frozen"
    )
    if recipe.kind == "grpo" and recipe.layout.reference.in_trainer:
        line += (
            "; reference: the base with the adapter off, scored in the trainer's processes "
            "(no GPU and no copy of the model of its own)"
        )
    return line


def _whole_gb(value: float) -> str:
    return f"{value:.0f}"


def _fine_gb(value: float) -> str:
    """GB in tenths below 10 (an adapter's checkpoint: 0.5), whole above."""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _count(n: float) -> str:
    """ "43.6 M", "8.19 B", "16.4 k": a parameter count, short."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


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


def kv_cut_note(cap: float, kv: float, call: int, at_once: int) -> str:
    """The note of a plan whose generator KV cache was cut from `kv` to `cap` GB so that the
    trainer's step fits beside it (`call` sequences a replica, `at_once` held at a time)."""
    return (
        f"note: the generator's KV cache is {cap:g} GB, cut from the {kv:g} GB that holds a "
        f"generate call's {call} sequences a replica at once, so that the trainer's step fits "
        f"beside it: vLLM holds ~{at_once} at a time and starts "
        "the others as those finish (the predicted step does not count the wait)"
    )


def lanes_kv_note(lanes: int, open_episodes: int, held: int) -> str:
    """The note of a plan whose generator KV cache holds fewer than the episodes its lanes keep
    open (`lanes` calls of a replica, `open_episodes` in all, ~`held` sequences at the longest)."""
    return (
        f"note: env.batches_in_flight {lanes} keeps {open_episodes} episodes open a replica, "
        f"and its KV cache holds ~{held} at the longest: between their turns one call's "
        "episodes may lose their cached prefixes to the other's and be prefilled again "
        "(env.batches_in_flight=1 keeps them)"
    )


def staler_policy_line(age: int, seconds: float, here: float) -> str:
    """The line of a plan whose step the staleness bound sets: `grpo.max_policy_age` `age`
    would take `seconds` a step against the plan's `here`."""
    return (
        f"grpo.max_policy_age {age} is predicted at {seconds:.2f} s a step against {here:.2f}: "
        f"each call may then start a step earlier, and its samples are trained on up to {age} "
        f"versions old, and each step may learn less (docs/how-it-works.md, the cost model); "
        f"--set grpo.max_policy_age={age}"
    )


def fresher_policy_line(age: int, seconds: float, here: float) -> str:
    """The line of an off-policy plan (grpo.max_policy_age `age`) where on-policy is predicted
    at `seconds` a step on the same layout, about the plan's `here`."""
    return (
        f"grpo.max_policy_age 0 (on-policy) is predicted at {seconds:.2f} s a step against "
        f"{here:.2f} on this layout: its services overlap too little for {age} version"
        f"{'s' if age > 1 else ''} of staleness to buy speed, and on-policy trains each sample "
        "on the version that made it; --set grpo.max_policy_age=0"
    )


def shorter_prompts_line(prompt: int, share: str, seconds: float, here: float) -> str:
    """The line of a plan ranked at the longest prompt: prompts averaging `prompt` tokens put
    layout.share `share` first (`seconds` a step against the chosen layout's `here`)."""
    return (
        f"prompts averaging {prompt} tokens or fewer put layout.share {share} "
        f"first by 10 % or more ({seconds:.2f} s a step against {here:.2f} at "
        f"{prompt}): --set dataset.prompt_tokens_mean=N (your prompts' mean, template "
        "and chat format included) ranks the layouts there"
    )


def layout_hint_line(
    chosen: Plan,
    prompt_tokens: float,
    response_tokens: float,
    share: str,
    seconds: float,
    here: float,
    ranked_at: str,
) -> str:
    """A run's line where, at its own mean lengths, layout.share `share` is predicted faster
    (`seconds` a step) than the layout its plan took at `ranked_at` (`here`)."""
    return (
        f"at this run's mean lengths ({prompt_tokens:.0f}-token prompts, "
        f"{response_tokens:.0f}-token completions) layout.share {share} is predicted at "
        f"{seconds:.2f} s a step, this plan ({chosen.share}) at {here:.2f} s; the plan ranked "
        f"layouts at {ranked_at}: --set layout.share={share} takes it, or "
        f"--set dataset.prompt_tokens_mean={round(prompt_tokens)} lets the plan weigh them "
        "at this run's prompts"
    )


def sft_lines(settings: dict[str, Any]) -> list[str]:
    """The plan's lines on an SFT run's settings (recipes.sft.settings_data), `*` where planned;
    gather_once only where there are ranks to gather over, or where the recipe set it."""

    def shown(key: str, value: Any, planned: bool) -> str:
        if isinstance(value, bool):
            value = "on" if value else "off"
        return f"{key} {value}{'*' if planned else ''}"

    trainer, planned = settings["trainer"], settings["planned"]
    one_rank = trainer["ranks"] == 1
    parts = [
        shown(k, v, f"trainer.{k}" in planned)
        for k, v in trainer.items()
        if k != "peak_gb" and (k != "gather_once" or not one_rank)
    ]
    if one_rank and "trainer.gather_once" not in planned:
        parts.append("gather_once off (one rank: nothing to gather)")
    sft = [
        shown("attention", settings["attention"], "sft.attention" in planned),
        shown("packing", settings["packing"], False),
    ]
    return [
        f"  {'trainer':<12}{', '.join(parts)} (~{trainer['peak_gb']:.0f} GB a rank)",
        f"  {'sft':<12}{', '.join(sft)}",
    ]
