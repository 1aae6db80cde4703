"""A model of a tools run's rollout pipeline: what a step would take, and how long the generator
would sit idle, for other `env.batches_in_flight` (lanes) and `grpo.max_policy_age` settings,
from the parts one measured run gives (bench/gpu_tools.py's JSON).

    python bench/lanes_model.py RUN.json[#SECTION] [--lanes 1 2 3] [--ages 1 2] [--steps 40]
        [--tool-s SECONDS]

The model runs the rollout loop's rules (runtime/control/rollouts.py) in simulated time, not
the runtime itself: each lane takes one call's prompts when the freshness rule and the buffer's
room admit it (the same test as `Rollouts._wait_until_fresh_enough`), opens its episodes, runs
`turns` rounds of one generator call (the replica serves one call at a time, in arrival order)
then one round of tools, closes its episodes and queues its groups; the trainer takes a step's
groups, trains (reference, step, publish and load) and bumps the version. From the run it takes:

- a round's generator call: the measured sampling seconds a step / turns an episode;
- opening and closing a call's episodes: their measured seconds (`open_s_per_step`,
  `close_s_per_step`) where the run has them;
- a round of tools: then the rest of the seconds waiting on the environments over the rounds (a
  round waits for its slowest call); in an older run, the mean seconds of a tool call, with the
  rest split half and half between opening and closing;
- the trainer's part of a step: reference + train + publish + weight sync seconds.

Its figures are a model's, never a measurement: bench/results quotes them beside the run they
came from, and a GPU run checks them.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class Parts:
    """What one step's work costs, in seconds (a call is one step's prompts)."""

    turn_s: float  # one round's generator call for a call's episodes
    tool_s: float  # one round of tools
    open_s: float  # opening a call's episodes
    close_s: float  # closing them (the rewards)
    train_s: float  # the trainer's part of a step, start to loaded version
    turns: int  # rounds an episode
    prompts_per_step: int = 16

    @classmethod
    def of_run(cls, section: dict[str, Any]) -> Parts:
        m = section["means"]
        turns = max(1, round(section["turns_mean"]))
        wait = section["env_wait_s_per_step"]
        opening, closing = section.get("open_s_per_step"), section.get("close_s_per_step")
        if opening is not None and closing is not None:
            tool = max(0.0, wait - opening - closing) / turns
        else:
            tool = section["tool_s_per_call"]
            opening = closing = max(0.0, wait - turns * tool) / 2
        trainer = sum(
            m.get(k, 0.0)
            for k in ("time/reference_s", "time/train_s", "time/publish_s", "time/weight_sync_s")
        )
        return cls(
            turn_s=m["episode/sampling_s"] / turns,
            tool_s=tool,
            open_s=opening,
            close_s=closing,
            train_s=trainer,
            turns=turns,
            # the run's calls are a step's prompts, each a group of the recipe's size
            prompts_per_step=section["episodes_per_step"] // group_size(section["recipe"]),
        )


def group_size(recipe: str) -> int:
    from recipes import load_recipe

    return load_recipe(recipe).grpo.group_size


Command = tuple[str, Any]
Process = Generator[Command, None, None]


class Pipeline:
    """The rollout loop's lanes, one generator replica and the trainer, in simulated time."""

    def __init__(self, parts: Parts, lanes: int, max_policy_age: int) -> None:
        self.p, self.lanes, self.age = parts, lanes, max_policy_age
        self.now = 0.0
        self.version = self.loaded = 0
        self.training = False
        self.buffer = self.in_flight = 0
        self.capacity = parts.prompts_per_step * (max_policy_age + 1)
        self.step_ends: list[float] = []
        self.busy: list[tuple[float, float]] = []  # the generator's calls, start and end
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._waiting: list[tuple[Callable[[], bool], Process]] = []
        self._engine: list[Process] = []  # calls queued at the replica
        self._engine_free = True
        self._seq = 0

    # --- the rules --------------------------------------------------------------------------

    def _admits(self, groups: int) -> bool:
        p = self.p.prompts_per_step
        queued = self.buffer + self.in_flight + groups - 1
        consumer = self.version + (1 if self.training else 0) + queued // p
        room = self.age == 0 or self.buffer + self.in_flight + groups <= self.capacity
        return self.loaded >= consumer - self.age and room

    def _lane(self) -> Process:
        groups = self.p.prompts_per_step
        while True:
            yield ("until", lambda: self._admits(groups))
            self.in_flight += groups
            yield ("sleep", self.p.open_s)
            for _ in range(self.p.turns):
                yield ("turn", None)
                yield ("sleep", self.p.tool_s)
            yield ("sleep", self.p.close_s)
            self.in_flight -= groups
            self.buffer += groups

    def _trainer(self, steps: int) -> Process:
        p = self.p.prompts_per_step
        for _ in range(steps):
            yield ("until", lambda: self.buffer >= p)
            self.buffer -= p
            self.training = True
            yield ("sleep", self.p.train_s)
            self.version += 1
            self.loaded = self.version
            self.training = False
            self.step_ends.append(self.now)

    # --- the clock ----------------------------------------------------------------------------

    def _at(self, t: float, event: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, event))

    def _advance(self, proc: Process) -> None:
        """Run `proc` to its next wait."""
        try:
            kind, arg = next(proc)
        except StopIteration:
            return
        if kind == "sleep":
            self._at(self.now + arg, lambda: self._advance(proc))
        elif kind == "until":
            if arg():
                self._advance(proc)
            else:
                self._waiting.append((arg, proc))
        else:  # a generator call: one at a time, in arrival order
            self._engine.append(proc)
            self._serve()

    def _serve(self) -> None:
        if self._engine_free and self._engine:
            self._engine_free = False
            proc = self._engine.pop(0)
            start, end = self.now, self.now + self.p.turn_s
            self.busy.append((start, end))
            self._at(end, lambda: self._served(proc))

    def _served(self, proc: Process) -> None:
        self._engine_free = True
        self._advance(proc)
        self._serve()

    def _wake(self) -> None:
        woke = True
        while woke:
            woke = False
            for i, (ready, proc) in enumerate(self._waiting):
                if ready():
                    del self._waiting[i]
                    self._advance(proc)
                    woke = True
                    break

    def run(self, steps: int) -> None:
        trainer = self._trainer(steps)
        self._advance(trainer)
        for _ in range(self.lanes):
            self._advance(self._lane())
        while self._events and len(self.step_ends) < steps:
            self.now, _, event = heapq.heappop(self._events)
            event()
            self._wake()

    def figures(self, warmup: int) -> dict[str, float]:
        """The step and the generator's idle share over the steps after `warmup`."""
        start, end = self.step_ends[warmup - 1], self.step_ends[-1]
        step = (end - start) / (len(self.step_ends) - warmup)
        busy = sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.busy)
        return {"step_s": step, "generator_idle_share": 1 - busy / (end - start)}


def model(parts: Parts, lanes: int, max_policy_age: int, steps: int = 40) -> dict[str, float]:
    pipe = Pipeline(parts, lanes, max_policy_age)
    pipe.run(steps)
    return pipe.figures(warmup=min(10, steps // 4))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a bench/gpu_tools.py JSON, FILE or FILE#SECTION")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--ages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--tool-s", type=float, help="a round of tools in seconds, instead of the run's call"
    )
    args = ap.parse_args(argv)
    path, _, name = args.run.partition("#")
    data = json.loads(Path(path).read_text())
    section = data[name or next(k for k in data if k.startswith("tools_"))]
    parts = Parts.of_run(section)
    if args.tool_s is not None:
        if args.tool_s < 0:
            print("lanes_model: --tool-s must be 0 or more")
            return 2
        parts = dataclasses.replace(parts, tool_s=args.tool_s)
    gpus = section["gpus"]
    print(
        f"from {args.run}: a round's call {parts.turn_s:.3f} s, tools {parts.tool_s:.3f} s, "
        f"open {parts.open_s:.3f} s, close {parts.close_s:.3f} s, trainer {parts.train_s:.3f} s "
        f"a step, {parts.turns} rounds; measured {section['step_s']:.2f} s a step, generator idle "
        f"{section['generator_idle_share']:.1%} (lanes {section.get('batches_in_flight', 1)}, "
        f"max_policy_age {section.get('max_policy_age')})"
    )
    print("| lanes | max_policy_age | s a step | samples/s per GPU | generator idle |")
    print("|---|---|---|---|---|")
    for age in args.ages:
        for lanes in args.lanes:
            f = model(parts, lanes, age, args.steps)
            rate = section["episodes_per_step"] / f["step_s"] / gpus
            print(
                f"| {lanes} | {age} | {f['step_s']:.2f} | {rate:.1f} | "
                f"{f['generator_idle_share']:.0%} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
