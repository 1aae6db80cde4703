"""Where a plan puts each service, and which services share a GPU.

A `Placement` is one service unit on one node's GPUs. The planner builds them; the cost model
and the runtime's turns read which units share each GPU from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Service = Literal["generator", "reference", "trainer", "reward"]


@dataclass(frozen=True)
class Placement:
    """One service unit on one node.

    generator and reference: one replica (its whole TP group). trainer: all its GPUs, on node 0
    (replica 0). reward: one CPU proc on node 0.
    `gpus` are local indices on `node` (what CUDA_VISIBLE_DEVICES gets); () on CPU.
    """

    service: Service
    replica: int
    node: int
    gpus: tuple[int, ...]


GPU_SERVICES = ("generator", "reference", "trainer")


def unit_name(placement: Placement) -> str:
    """What takes turns on a GPU: a generator replica ("generator0"), the reference, the
    trainer (all its ranks)."""
    return (
        f"generator{placement.replica}" if placement.service == "generator" else placement.service
    )


def gpu_units(placements: Iterable[Placement]) -> dict[tuple[int, int], set[str]]:
    """The GPU units on each GPU of the plan, keyed by (node, GPU index)."""
    units: dict[tuple[int, int], set[str]] = {}
    for p in placements:
        if p.service not in GPU_SERVICES or not p.gpus:
            continue
        for gpu in p.gpus:
            units.setdefault((p.node, gpu), set()).add(unit_name(p))
    return dict(sorted(units.items()))


def shared_gpus(placements: Iterable[Placement]) -> dict[tuple[int, int], set[str]]:
    """The GPUs on which units must take turns (runtime/control/turns.py): two or more units.

    Turns are per GPU: units that share no GPU run at once even where a third unit spans both
    (two generators, each on a GPU of its own, beside a trainer over both GPUs)."""
    return {gpu: units for gpu, units in gpu_units(placements).items() if len(units) > 1}


def shared_services(placements: tuple[Placement, ...]) -> frozenset[str]:
    """The GPU services whose GPUs another service's placement also uses."""
    owners: dict[tuple[int, int], set[str]] = {}
    for p in placements:
        for gpu in p.gpus:
            owners.setdefault((p.node, gpu), set()).add(p.service)
    return frozenset(s for services in owners.values() if len(services) > 1 for s in services)
