"""Runs the `tiny` recipe with its generator, reference and trainer placed on one GPU index.

    python tests/shared_gpu_app.py RUN_DIR [--set KEY=VALUE ...]

On a CPU host the index only sets CUDA_VISIBLE_DEVICES (the procs still compute on the CPU), but
the plan says the three services share a GPU, so the controller makes their calls take turns:
what test_turns checks end to end with real Monarch procs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from recipes import apply_overrides, load_recipe, plan
    from runtime.control.config import RunConfig
    from runtime.control.run import run

    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=Path)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    recipe = apply_overrides(load_recipe("tiny"), args.set)
    base = plan(recipe, 0)
    on_gpu0 = tuple(
        dataclasses.replace(pl, gpus=(0,)) if pl.service != "reward" else pl
        for pl in base.placements
    )
    return run(RunConfig(recipe=recipe, plan=dataclasses.replace(base, placements=on_gpu0),
                         run_dir=args.run_dir))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
