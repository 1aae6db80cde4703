"""The recipe's `env` section: multi-turn episodes with tool calls, the environment they call
tools in, and how the run hosts it (worker processes beside the generator, docs/tools.md).

    env:
      name: builtin:python            # or mypkg.envs:MyEnvironment (an OpenEnv Environment)
      args: {}                        # keyword arguments the class is built with
      cpus_per_episode: null          # CPU cores an episode's tools take while they run
      workers_per_node: auto          # CPU worker processes hosting the episodes on node 0
      cpu_nodes: 0                    # CPU-only nodes for the workers node 0 has no cores for
                                      # (auto: as many as the plan finds short)
      batches_in_flight: 2            # episode calls a generator replica runs at once
      max_turns: 4                    # model turns an episode may take
      max_turn_tokens: null           # tokens the model may sample in one turn
      max_episode_tokens: null        # tokens an episode may hold, its opening prompt included
      turn_rewards: false             # add the rewards of tool calls to the episode's reward
      call_timeout_s: 30              # one tool call; past it the worker is replaced
      episode_timeout_s: 300          # a whole episode; past it the episode is dropped
      sandbox: {cpu_seconds: 5, memory_mb: 512, wall_seconds: 10, disk_mb: 16}

A recipe without the section has single-turn rollouts. With it, each completion is an episode
that alternates the model's turns with the tools' results, in the model family's chat format,
and the environment gives the reward (the dataset then needs none). Every number is > 0
(cpu_nodes >= 0); the class is found and checked without importing it (recipes/references.py),
the way a custom reward is.

The planner sizes the workers (`env_plan`): the episodes in flight at once (every generator
replica's env.batches_in_flight calls, each its prompts x grpo.group_size) times
`cpus_per_episode` are the cores the tools may take at once, weighed against the cores node 0
has left beside its own processes; the cores it lacks can go to CPU-only nodes after the run's
own (env.cpu_nodes; launched with them as a SkyPilot job group, launcher/task.py; hosted by
runtime/environments/nodes.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from recipes.errors import UserError
from recipes.fields import Strict
from recipes.names import BUILTIN_ENVIRONMENTS

_CLASS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")

# CPU cores an episode's tools take while they run, where env.cpus_per_episode is not set: the
# Python sandbox runs the model's program in a process of its own (a core while it runs);
# tiny-tools looks a digit up (microseconds). An environment of your own: a core, unless set.
BUILTIN_CPUS_PER_EPISODE: dict[str, float] = {"python": 1.0, "tiny-tools": 0.005}
OWN_CPUS_PER_EPISODE = 1.0
# Cores node 0's own processes take: the controller (its run loop, tokenizing the episodes'
# turns), and per GPU the proc that drives it (a trainer rank or a generator worker, with vLLM's
# engine loop beside it); on CPU, each service's process.
CONTROLLER_CORES = 2
CORES_PER_GPU = 2
# The most environment workers `auto` starts on a node, however many cores it has.
MAX_AUTO_WORKERS = 64
# Where node 0 lacks the cores, CPU-only nodes of CPU_NODE_VCPUS_FOR_ENV vCPUs or more (what
# launch asks SkyPilot for) host the rest, a core of each kept for its own runtime; at most
# MAX_CPU_NODES of them.
CPU_NODE_VCPUS_FOR_ENV = 32
MAX_CPU_NODES = 16


def _count_or_auto(n: Any, least: int, most: int) -> Any:
    if isinstance(n, str) and n.strip().isdigit():  # from --set
        n = int(n)
    if n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and least <= n <= most):
        return n
    if isinstance(n, int) and not isinstance(n, bool) and n > most:
        raise PydanticCustomError(
            "count", "Input should be at most {most}, or auto", {"most": most}
        )
    word = "greater than 0" if least == 1 else f"{least} or more"
    raise PydanticCustomError("count", "Input should be {word}, or auto", {"word": word})


class Sandbox(Strict):
    """What one run of model-written code may use (runtime/environments/sandbox.py)."""

    cpu_seconds: float = Field(default=5.0, gt=0)
    memory_mb: int = Field(default=512, gt=0)
    wall_seconds: float = Field(default=10.0, gt=0)
    disk_mb: int = Field(default=16, gt=0)
    output_chars: int = Field(default=4000, gt=0)
    # namespaces: user + network + mount namespaces and rlimits; rlimits: the limits alone, for
    # machines that permit no user namespaces (the network and filesystem are then not isolated)
    isolation: Literal["namespaces", "rlimits"] = "namespaces"


class Environment(Strict):
    """Where a multi-turn episode's tools come from and the bounds it runs within."""

    name: str
    args: dict[str, Any] = {}
    # default: BUILTIN_CPUS_PER_EPISODE for a shipped environment, else OWN_CPUS_PER_EPISODE
    cpus_per_episode: float | None = Field(default=None, gt=0)
    # auto: the planner's count (env_plan), from the cores the episodes need and the node's
    workers_per_node: int | Literal["auto"] = "auto"
    # CPU-only nodes beside the run's own for the workers node 0 has no cores for (auto: as
    # many as the cores short need, 0 where none are short); they launch as a managed job group
    # and cost beyond the plan's price, so none unless asked for
    cpu_nodes: int | Literal["auto"] = 0
    # Episode calls (a call's prompts x group_size episodes) a generator replica runs at once:
    # while one call's episodes wait on their tools, another's turns sample, so the generator
    # does not idle through the tools' rounds. Each call is admitted by the freshness rule
    # (grpo.max_policy_age), as one call is; in lock-step the second waits for the first's step.
    batches_in_flight: int = Field(default=2, gt=0, le=8)
    max_turns: int = Field(default=4, gt=0)
    # default: grpo.max_response_tokens (what is left of the episode's budget bounds it too)
    max_turn_tokens: int | None = Field(default=None, gt=0)
    # default: grpo.max_prompt_tokens + grpo.max_response_tokens, the longest sequence the plan
    # sizes the trainer for; the tokens after the opening prompt are at most
    # grpo.max_response_tokens either way
    max_episode_tokens: int | None = Field(default=None, gt=0)
    turn_rewards: bool = False
    call_timeout_s: float = Field(default=30.0, gt=0)
    episode_timeout_s: float = Field(default=300.0, gt=0)
    sandbox: Sandbox = Sandbox()

    @field_validator("workers_per_node", mode="before")
    @classmethod
    def _some_workers(cls, n: Any) -> Any:
        return _count_or_auto(n, 1, MAX_AUTO_WORKERS * 16)

    @field_validator("cpu_nodes", mode="before")
    @classmethod
    def _some_nodes(cls, n: Any) -> Any:
        return _count_or_auto(n, 0, MAX_CPU_NODES)

    @field_validator("name")
    @classmethod
    def _a_class(cls, name: str) -> str:
        if name.startswith("builtin:"):
            short = name.removeprefix("builtin:")
            if short not in BUILTIN_ENVIRONMENTS:
                raise PydanticCustomError(
                    "environment",
                    "no shipped environment named '{name}' (shipped: {known}); or name your own "
                    "as module:Class",
                    {"name": short, "known": ", ".join(BUILTIN_ENVIRONMENTS)},
                )
        elif not _CLASS.fullmatch(name):
            raise PydanticCustomError(
                "environment",
                "'{name}' is neither builtin:<name> ({known}) nor module:Class (an OpenEnv "
                "Environment, e.g. mypkg.envs:LookupEnv)",
                {"name": name, "known": ", ".join(BUILTIN_ENVIRONMENTS)},
            )
        return name

    @property
    def builtin(self) -> bool:
        return self.name.startswith("builtin:")

    @property
    def cores_per_episode(self) -> float:
        """`cpus_per_episode`, or the environment's default."""
        if self.cpus_per_episode is not None:
            return self.cpus_per_episode
        if self.builtin:
            return BUILTIN_CPUS_PER_EPISODE[self.name.removeprefix("builtin:")]
        return OWN_CPUS_PER_EPISODE

    def episode_tokens(self, grpo: Any) -> int:
        """The tokens an episode may hold, its opening prompt included."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return grpo.max_prompt_tokens + grpo.max_response_tokens


def episodes_in_flight(recipe: Any, replicas: int) -> int:
    """Episodes open at once: each generator replica's env.batches_in_flight calls, each its
    share of prompts_per_step x steps_per_call prompts (runtime/control/rollouts.py `per_call`)
    times group_size episodes. A call opens its episodes once the same lane's last call's have
    closed, so this is the most."""
    g = recipe.grpo
    per_call = max(1, math.ceil(g.prompts_per_step * g.steps_per_call / replicas))
    return replicas * recipe.env.batches_in_flight * per_call * g.group_size


def own_cores(cpu: bool, placements: Any, reward_procs: int) -> int:
    """Cores node 0's own processes take: the controller's, and on GPUs CORES_PER_GPU for each
    GPU of node 0 a service uses plus a core for each reward proc; on CPU a core for each of the
    service processes on node 0 (their `placements`)."""
    on_node0 = [p for p in placements if p.node == 0]
    if cpu:
        return CONTROLLER_CORES + len(on_node0)
    gpus = len({g for p in on_node0 for g in p.gpus})
    return CONTROLLER_CORES + CORES_PER_GPU * gpus + reward_procs


# How CPU nodes launch, and what the plan's price leaves out (the catalog snapshot holds GPU
# nodes only).
_CPU_NODES_NOTE = " (a managed job group, --managed; their price is not in the cost below)"


@dataclass(frozen=True)
class EnvPlan:
    """Where a run's environment workers go and why: the cores its episodes' tools may take at
    once (`episodes` in flight x `cores_per_episode` = `cores_needed`) against what node 0 has
    left (`node_vcpus` less `own_cores`); `workers` worker processes on node 0. `node_vcpus`
    is None where it is not known (no catalog offer of the node); `short` the cores the node
    lacks (0: it has them)."""

    episodes: int
    cores_per_episode: float
    cores_needed: float
    node_vcpus: float | None
    own_cores: int
    workers: int
    workers_from: str  # "auto" or "env.workers_per_node"
    node_source: str  # what node_vcpus is: an instance type, this machine, ...
    # CPU-only nodes for the rest (plan nodes num_nodes ..), each of cpu_node_vcpus or more
    # with cpu_node_workers workers
    cpu_nodes: int = 0
    cpu_node_vcpus: int = CPU_NODE_VCPUS_FOR_ENV
    cpu_node_workers: int = 0
    # the CPU nodes env.cpu_nodes auto would add (what `short` needs)
    cpu_nodes_auto: int = 0

    @property
    def free_cores(self) -> float | None:
        return None if self.node_vcpus is None else max(0.0, self.node_vcpus - self.own_cores)

    @property
    def short(self) -> float:
        free = self.free_cores
        return 0.0 if free is None else round(max(0.0, self.cores_needed - free), 2)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "free_cores": self.free_cores, "short": self.short}

    def words(self) -> str:
        """One line: episodes x cores = needed, the node's vCPUs, where the workers go."""
        need = (
            f"{self.episodes} episodes in flight x {self.cores_per_episode:g} core"
            f"{'' if self.cores_per_episode == 1 else 's'} = {self.cores_needed:g} cores"
        )
        workers = f"{self.workers} worker{'' if self.workers == 1 else 's'} on node 0"
        if self.workers_from != "auto":
            workers += f" ({self.workers_from})"
        if self.node_vcpus is None:
            return (
                f"environment cores: {need}; node 0's vCPUs unknown ({self.node_source}): {workers}"
            )
        node = (
            f"node 0 has {self.node_vcpus:g} vCPUs ({self.node_source}), {self.own_cores} "
            f"for its own processes"
        )
        if self.short and self.cpu_nodes:
            n = self.cpu_nodes
            return (
                f"environment cores: {need}; {node}: {workers}, {self.short:g} cores short: "
                f"{n} CPU node{'' if n == 1 else 's'} of {self.cpu_node_vcpus}+ vCPUs beside "
                f"the run's with {self.cpu_node_workers} workers each{_CPU_NODES_NOTE}"
            )
        if self.cpu_nodes:
            return (
                f"environment cores: {need}; {node}: {workers}, and {self.cpu_nodes} CPU "
                f"node{'' if self.cpu_nodes == 1 else 's'} (env.cpu_nodes) with "
                f"{self.cpu_node_workers} worker{'' if self.cpu_node_workers == 1 else 's'} each"
                f"{_CPU_NODES_NOTE}"
            )
        if self.short and self.cpu_nodes_auto:
            n = self.cpu_nodes_auto
            return (
                f"environment cores: {need}; {node}: {workers}, {self.short:g} cores short (the "
                "tools' calls wait for cores; --set env.cpu_nodes=auto puts the rest on "
                f"{n} CPU node{'' if n == 1 else 's'} of {self.cpu_node_vcpus}+ vCPUs, a "
                "managed job group)"
            )
        if self.short:
            return (
                f"environment cores: {need}; {node}: {workers}, {self.short:g} cores short "
                "(the tools' calls wait for cores)"
            )
        return f"environment cores: {need}; {node}: {workers}"


def auto_workers(needed: float, free: float | None) -> int:
    """workers_per_node auto: a worker per core needed (at least 1), within the `free` cores (at
    least 1; None: not known) and MAX_AUTO_WORKERS."""
    workers = math.ceil(needed)
    if free is not None:
        workers = min(workers, max(1, math.floor(free)))
    return max(1, min(workers, MAX_AUTO_WORKERS))


def env_plan(
    recipe: Any,
    replicas: int,
    node_vcpus: float | None,
    own: int,
    node_source: str,
    cpu_run: bool = False,
) -> EnvPlan | None:
    """The plan of a multi-turn run's environment workers (None for a single-turn run): the
    cores its episodes need against node 0's `node_vcpus` less its `own` processes' cores, and
    the CPU nodes for the cores it lacks (env.cpu_nodes auto), each with a worker per core it
    takes there (more than MAX_CPU_NODES: `check_env_plan` refuses the chosen plan)."""
    env = getattr(recipe, "env", None)
    if env is None:
        return None
    episodes = episodes_in_flight(recipe, replicas)
    per = env.cores_per_episode
    needed = round(episodes * per, 2)
    free = None if node_vcpus is None else max(0.0, node_vcpus - own)
    if env.workers_per_node == "auto":
        workers, source = auto_workers(needed, free), "auto"
    else:
        workers, source = env.workers_per_node, "env.workers_per_node"
    short = 0.0 if free is None else max(0.0, needed - free)
    per_node = CPU_NODE_VCPUS_FOR_ENV - 1  # a core for the node's own runtime
    # a CPU recipe runs on one machine or its own CPU nodes: auto adds none
    wanted = 0 if cpu_run else math.ceil(round(short, 2) / per_node)
    nodes = wanted if env.cpu_nodes == "auto" else env.cpu_nodes
    node_workers = 0
    if nodes:
        node_workers = max(1, min(math.ceil(short / nodes), per_node, MAX_AUTO_WORKERS))
    return EnvPlan(
        episodes, per, needed, node_vcpus, own, workers, source, node_source,
        nodes, CPU_NODE_VCPUS_FOR_ENV, node_workers, wanted,
    )  # fmt: skip


def check_env_plan(recipe: Any, planned: EnvPlan | None) -> None:
    """The run's plan asks for more than MAX_CPU_NODES CPU nodes: one line (UserError)."""
    if planned is None or planned.cpu_nodes <= MAX_CPU_NODES:
        return
    raise UserError(
        f"{recipe.name}: {planned.episodes} episodes in flight x {planned.cores_per_episode:g} "
        f"cores need {planned.cores_needed:g} cores, {planned.short:g} more than node 0 has: "
        f"{planned.cpu_nodes} CPU nodes of {planned.cpu_node_vcpus} vCPUs, more than "
        f"{MAX_CPU_NODES}; lower env.cpus_per_episode, env.batches_in_flight or "
        "grpo.prompts_per_step (or set env.cpu_nodes)"
    )


def node_env_plan(
    recipe: Any,
    cpu: bool,
    placements: Any,
    replicas: int,
    node_vcpus: float | None,
    node_source: str,
) -> EnvPlan | None:
    """`env_plan` for node 0 of a run placed as `placements`, with `node_vcpus`."""
    if getattr(recipe, "env", None) is None:
        return None
    own = own_cores(cpu, placements, recipe.layout.reward.procs)
    return env_plan(recipe, replicas, node_vcpus, own, node_source, cpu_run=cpu)


def planned_node(accelerator: str, per_node: int) -> tuple[float | None, str]:
    """Node 0's vCPUs as planned, and what they are: for GPUs, the catalog's node of `per_node`
    `accelerator`s with the fewest (recipes/prices.py: whichever cloud SkyPilot picks, it has at
    least those); on CPU, what launch asks for (CPU_NODE_VCPUS or more)."""
    if accelerator == "cpu":
        from recipes.names import CPU_NODE_VCPUS

        return CPU_NODE_VCPUS, f"a CPU node of {CPU_NODE_VCPUS}+ vCPUs, as launched"
    from recipes.prices import price_book

    offer = price_book().fewest_vcpus(accelerator, per_node)
    if offer is None:
        return None, f"no catalog offer of {per_node} {accelerator} a node"
    return offer.vcpus, f"the fewest of {per_node} {accelerator} a node: {offer.instance_type}"


def env_words(recipe: Any, workers: int | None = None) -> str:
    """The plan's line on a multi-turn run (empty for a single-turn one); `workers`: the
    planned count where env.workers_per_node is auto."""
    env = getattr(recipe, "env", None)
    if env is None:
        return ""
    count = env.workers_per_node if workers is None else workers
    sandbox = ""
    if env.name == "builtin:python":
        s = env.sandbox
        sandbox = (
            f"; sandbox {s.cpu_seconds:g} CPU s, {s.memory_mb} MB, {s.wall_seconds:g} s wall"
            + (", rlimits only" if s.isolation == "rlimits" else "")
        )
    return (
        f"environment {env.name}: {count} CPU worker"
        f"{'' if count == 1 else 's'} on node 0, up to {env.max_turns} turn"
        f"{'' if env.max_turns == 1 else 's'} and {env.episode_tokens(recipe.grpo)} tokens an episode, "
        f"timeouts {env.call_timeout_s:g} s a call, {env.episode_timeout_s:g} s an episode"
        f"{sandbox}"
    )
