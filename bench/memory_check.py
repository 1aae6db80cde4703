"""The memory model against committed GPU runs: the trainer's estimated peaks and the plan's
GB per GPU next to what the runs measured.

    python bench/memory_check.py                  # print the rows
    python bench/memory_check.py --out bench/results/memory_model_check.json
    python bench/memory_check.py --check          # exit 1 if that file is out of date

For each run in RUNS, with today's recipes/memory.py and planner:

- trainer step: `trainer_fixed_bytes + tokens x trainer_token_bytes` at the run's ranks,
  micro-batch and activation checkpointing, plus a version's CUDA IPC buffer where the run was
  off-policy on the ipc path (what the trainer's memory plan budgets; not in a product run B
  that trained only the step after its resume: the resumed version is loaded before any
  generation, and its buffer freed, before that step) and the push path's own buffer where it
  kept one, against the largest `memory/train_gb` the run recorded (trainer rank 0's CUDA
  allocator in a step);
- start-up: the largest `memory/startup_gb` (the weights built and loaded, before any step),
  which must stay below the step's estimate;
- checkpoint: what a rank holds between steps (`trainer_checkpoint_bytes`) and the push path's
  own buffer, against the largest `memory/checkpoint_gb` (the step that started a write: its
  state copied to host memory, nothing gathered);
- publish (the CUDA IPC path, whose flat buffer lives from a publish until the generators have
  loaded it): `trainer_publish_gb`, against the largest `memory/publish_gb`; where other
  generators took the push path in a run from before the push sent the ipc path's buffer
  (PUSH_BORROWS_IPC_BUFFER), plus the push buffer that run kept;
- per GPU: the GB/GPU of the plan the run had (`plan()` at the run's overrides, its services'
  figures added up where they share a GPU), the plan's figure while the trainer steps
  (`while_training`, what `plan` prints, at the run's micro-batch: the step estimate, the
  buffer a version goes out from on rank 0, and the services sharing the GPU), and the run's
  nvidia-smi peak (every process and allocator cache; a generator with a GPU of
  its own takes `gpu_memory_utilization` of it whatever it needs).

The trainer-alone runs in TRAINER_ALONE add a step row per config (no plan, no other
service). error = estimate / measured - 1: below 0 the model promises less than the run took.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "memory_model_check.json"

# (file, section, gpus, accelerator): runs that recorded their trainer's allocator peaks. The
# section of a bench/gpu_grpo.py file names its run; of a bench/product_path.py file, None
# takes both runs' peaks (one plan for both), "run_a" or "run_b" one of them (run B on the
# file's resume_gpus), "metrics" the records of `<file stem>_metrics.jsonl` beside it (a run A
# that ended before the bench could read them).
RUNS = (
    ("gpu_h100_2026-11-25/gpu_grpo_1gpu.json", "grpo_1gpu_on_policy", 1, "H100"),
    ("gpu_h100_2026-11-25b/host_a_product_path.json", None, 1, "H100"),
    ("gpu_h100x2_2026-11-25/side_by_side_runs.json", "grpo_2gpu_on_policy", 2, "H100"),
    ("gpu_h100x2_2026-11-25/side_by_side_runs.json", "grpo_2gpu_off_policy", 2, "H100"),
    ("gpu_h200x2_2026-11-26/product_path_qwen3-1.7b.json", "run_a", 2, "H200"),
    ("gpu_h200x2_2026-11-26/product_path_qwen3-1.7b.json", "run_b", 1, "H200"),
    ("gpu_h200x2_2026-11-26/qwen3-8b_4.json", "metrics", 2, "H200"),
    ("gpu_h200x2_2026-11-26b/product_path_qwen3-8b.json", None, 2, "H200"),
    ("gpu_h200x2_2026-11-26c/product_path_llama3.1-8b.json", None, 2, "H200"),
    ("gpu_h100x2_2026-11-26d/product_path_qwen3-1.7b.json", "run_a", 2, "H100"),
    ("gpu_h100x2_2026-11-26d/product_path_qwen3-1.7b.json", "run_b", 1, "H100"),
    ("gpu_h200x4_2026-11-27/product_path_qwen3-8b_part_b.json", "run_a", 2, "H200"),
    ("gpu_h200x4_2026-11-27/product_path_qwen3-8b_part_b.json", "run_b", 4, "H200"),
    ("gpu_h200x4_2026-11-27b/product_path_llama3.1-8b_part_b.json", "run_a", 2, "H200"),
    ("gpu_h200x4_2026-11-27b/product_path_llama3.1-8b_part_b.json", "run_b", 4, "H200"),
    ("gpu_h200x4_2026-11-27c/product_path_qwen3-8b_part_b.json", "run_a", 2, "H200"),
    ("gpu_h200x4_2026-11-27c/product_path_qwen3-8b_part_b.json", "run_b", 4, "H200"),
    ("gpu_h200x2_2026-11-27d/product_path_qwen3-8b_part_a.json", "run_a", 2, "H200"),
    ("gpu_h200_2026-11-27e/product_path_qwen3-1.7b.json", None, 1, "H200"),
    ("gpu_h200_2026-11-27f/product_path_1gpu.json", None, 1, "H200"),
    ("gpu_h200x2_2026-11-27g/product_path_qwen3-8b_part_b.json", "run_a", 2, "H200"),
    ("gpu_h200x2_2026-11-27g/product_path_qwen3-8b_part_b.json", "run_b", 2, "H200"),
    ("gpu_h200x2_2026-11-29-tools-8b/gpu_grpo_full8b.json", "grpo", 2, "H200"),
)
# Runs whose push path sent the ipc path's buffer of a version (runtime/weights/push.py
# `lend_from`); in the runs before, rank 0 kept a push buffer of its own beside it, and their
# publish estimate counts it as those runs had it.
PUSH_BORROWS_IPC_BUFFER = frozenset(
    {
        "gpu_h200x4_2026-11-27b",
        "gpu_h200x4_2026-11-27c",
        "gpu_h200x2_2026-11-27d",
        "gpu_h200_2026-11-27e",
        "gpu_h200_2026-11-27f",
        "gpu_h200x2_2026-11-27g",
    }
)
# Runs whose publishes gathered a whole version at once somewhere: versions piling up on-policy
# (qwen3-8b_4), and a resumed run's first publish laying out the flat buffer from the gathered
# version (before the layout came from the trainer's meta tensors). Their publish peaks are
# above today's estimate, which counts a group at a time.
PUBLISH_GATHERED_WHOLE = frozenset(
    {"gpu_h200x2_2026-11-26/qwen3-8b_4.json", "gpu_h200x2_2026-11-26b/product_path_qwen3-8b.json"}
)
# The trainer alone (bench/gpu_grpo.py train): one rank, 64 sequences of 2048 tokens, a config
# a row, each with its peak allocated memory.
TRAINER_ALONE = (("gpu_trainer_h200_2026-11-22.json", "trainer_mfu"),)
GB = 1e9


def _run(file: str, name: str | None) -> dict[str, Any]:
    """What a row needs of a run: recipe, overrides, trainer settings, peaks, nvidia-smi."""
    from gpu_memory import trainer_peaks

    from runtime.control.metrics import read_metrics

    data = json.loads((RESULTS / file).read_text())
    if name in (None, "run_a", "run_b", "metrics"):  # bench/product_path.py
        stem = (RESULTS / file).with_suffix("")
        if name == "metrics":
            peaks = trainer_peaks(read_metrics(stem.with_name(stem.name + "_metrics.jsonl")))
            log = stem.with_name(stem.name + "_run_a.log").read_text()
            line = next((x for x in log.splitlines() if "] trainer: " in x), None)
        else:
            parts = ("run_a", "run_b") if name is None else (name,)
            peaks = trainer_peaks([data[part].get("trainer_memory") or {} for part in parts])
            line = data[parts[-1]].get("trainer") or _logged_trainer_line(stem, parts[-1])
        phase = "run B" if name == "run_b" else "run A"
        smi = {str(g): gb for g, gb in data["gpu_used_peak_gb"][phase].items()}
        return {
            "recipe": data["recipe"],
            # run B alone trained only the step after its resume: no generation was in flight
            # to keep a version's IPC buffer through it (the resumed version is loaded first)
            "one_step_after_start": name == "run_b" and _steps_after_resume(data) == 1,
            "overrides": list(data["settings_changed"]),
            # the micro-batch and checkpointing the run had (planned by the model of its day)
            "as_run": _as_run(line),
            "peaks": peaks,
            "nvidia_smi": smi,
        }
    run = data[name]
    memory = run.get("memory") or {}
    trainer = (run.get("settings") or {}).get("trainer") or {}
    as_run = [
        f"trainer.{key}={str(trainer[key]).lower()}"
        for key in ("tokens_per_micro_batch", "activation_checkpointing")
        if key in trainer
    ]
    # a run from before trainer.gather_once resharded after every micro-batch
    as_run.append(f"trainer.gather_once={str(trainer.get('gather_once', False)).lower()}")
    return {
        "recipe": run["recipe"],
        "overrides": list(run["overrides"]) + list(run.get("set_by_hand") or []),
        # the micro-batch and checkpointing the run had (its resolved settings)
        "as_run": as_run,
        "peaks": trainer_peaks(run["records"]),
        "nvidia_smi": memory.get("nvidia_smi_peak_gb_per_gpu"),
    }


def _steps_after_resume(data: dict[str, Any]) -> int | None:
    """Steps product_path's run B trained: grpo.steps less the checkpoint it resumed from."""
    found = dict(
        item.split("=", 1) for item in data["settings_changed"] if item.startswith("grpo.")
    )
    try:
        return int(found["grpo.steps"]) - int(found["grpo.checkpoint_interval"])
    except (KeyError, ValueError):
        return None


def _logged_trainer_line(stem: Path, part: str) -> str | None:
    """The `trainer: ...` line of a product run's log beside its JSON (`<stem>*_run_a.log`),
    for JSONs written before the bench kept it."""
    for log in sorted(stem.parent.glob(f"{stem.name}*_{part}.log")):
        for text in log.read_text().splitlines():
            if "] trainer: " in text:
                return text
    return None


def _as_run(line: str | None) -> list[str]:
    """Overrides for the micro-batch, activation checkpointing and gathering once a run's
    `trainer: ...` line says it had (none without the line)."""
    import re

    found = re.search(
        r"(\d+) tokens per micro-batch, activation checkpointing (on|off)", line or ""
    )
    if not found:
        return []
    once = "the weights gathered once a step" in (line or "")
    return [
        f"trainer.tokens_per_micro_batch={found[1]}",
        f"trainer.activation_checkpointing={'true' if found[2] == 'on' else 'false'}",
        f"trainer.gather_once={'true' if once else 'false'}",
    ]


def rows() -> list[dict[str, Any]]:
    from gpu_memory import plan_gb_per_gpu

    from recipes import apply_overrides, load_recipe, plan
    from recipes.errors import UserError
    from recipes.gpu_plan import while_training
    from recipes.memory import (
        ACCELERATOR_BYTES,
        trainer_checkpoint_bytes,
        trainer_publish_gb,
        trainer_step_bytes,
    )
    from recipes.settings import ipc_buffer_held, push_buffer_bytes

    out = []
    for file, name, gpus, accelerator in RUNS:
        run = _run(file, name)
        recipe = apply_overrides(load_recipe(run["recipe"]), run["overrides"] + run["as_run"])
        refused = None
        try:
            p = plan(recipe, gpus, accelerator=accelerator)
        except UserError as e:
            if not run["as_run"]:
                raise
            # today's planner refuses what the run had: its settings, and the plan as it is now
            refused = str(e)
            today = apply_overrides(load_recipe(run["recipe"]), run["overrides"])
            p = plan(today, gpus, accelerator=accelerator)
        t = p.settings.trainer
        arch, ranks = recipe.arch, t.ranks
        tokens, ckpt = (
            recipe.trainer.tokens_per_micro_batch,
            recipe.trainer.activation_checkpointing,
        )
        tokens = t.tokens_per_micro_batch if tokens == "auto" else tokens
        ckpt = t.activation_checkpointing if ckpt == "auto" else ckpt
        step = trainer_step_bytes(arch, ranks, tokens, ckpt, t.compile)
        sync = p.settings.weight_sync
        ipc = "ipc" in sync.expected
        # off-policy, rank 0 holds a version's CUDA IPC buffer through the next step
        held = ipc_buffer_held(recipe, sync.transport, sync.expected)
        if run.get("one_step_after_start"):
            held = 0.0
        # the push path's own buffer lives from its first version on, steps included (beside
        # the ipc path, only in runs from before the push sent the ipc path's buffer)
        own = push_buffer_bytes(recipe, sync.transport, sync.expected)
        if "push" in sync.expected and file.split("/")[0] not in PUSH_BORROWS_IPC_BUFFER:
            own = push_buffer_bytes(recipe, sync.transport, ("push",))
        step += held + own
        peaks = run["peaks"]
        per_gpu = plan_gb_per_gpu(p)
        # the plan's own figure while the trainer steps, at the run's micro-batch
        as_run = dataclasses.replace(
            p.settings,
            trainer=dataclasses.replace(
                t, tokens_per_micro_batch=tokens, activation_checkpointing=ckpt
            ),
        )
        training = while_training(recipe, as_run, p.placements, p.memory)
        at_step = {
            g: round(sum(training[f"node 0 GPU {g}"].values()), 1)
            if f"node 0 GPU {g}" in training
            else v
            for g, v in per_gpu.items()
        }
        row: dict[str, Any] = {
            "run": f"bench/results/{file}" + (f"#{name}" if name else ""),
            "device": accelerator,
            "layout": p.share,
            "trainer": {
                "ranks": ranks,
                "tokens_per_micro_batch": tokens,
                "activation_checkpointing": ckpt,
                "compile": t.compile,
            },
            "step_gb": _pair(step / GB, peaks.get("memory/train_gb")),
            "step_gb_ipc_buffer": round(held / GB, 1),
            "step_gb_push_buffer": round(own / GB, 1),
            "startup_gb_measured": peaks.get("memory/startup_gb"),
            "startup_below_step_estimate": peaks.get("memory/startup_gb", 0.0) < step / GB,
        }
        if "memory/checkpoint_gb" in peaks:
            # a checkpoint write copies the sharded state to host memory: what a rank holds
            # whatever the micro-batch, beside the push path's own buffer (the runs measured
            # no IPC buffer left by then: the generators had loaded the version)
            row["checkpoint_gb"] = _pair(
                (trainer_checkpoint_bytes(arch, ranks) + own) / GB,
                peaks["memory/checkpoint_gb"],
            )
        if refused:
            row["refused_by_todays_plan"] = refused
        if ipc:
            # beside the push path's own buffer, where it has one
            row["publish_gb"] = _pair(
                trainer_publish_gb(arch, ranks) + own / GB, peaks.get("memory/publish_gb")
            )
            if file in PUBLISH_GATHERED_WHOLE:
                row["publish_gathered_a_whole_version"] = True
        row["per_gpu_gb"] = {
            "plan": per_gpu,
            "plan_with_trainer_step": at_step,
            "nvidia_smi": run["nvidia_smi"],
            "gpu": round(ACCELERATOR_BYTES[accelerator] / GB, 1),
        }
        out.append(row)
    for file, name in TRAINER_ALONE:
        data = json.loads((RESULTS / file).read_text())
        run = data[name]
        arch = load_recipe(run["recipe"]).arch
        device = "H200" if "H200" in data["device"]["name"] else "H100"
        for config in run["configs"]:
            ckpt = bool(config["ac"])
            step = trainer_step_bytes(arch, 1, config["mb"], ckpt, bool(config["compile"]))
            out.append(
                {
                    "run": f"bench/results/{file}#{name} {config['config']}",
                    "device": device,
                    "layout": "trainer alone",
                    "trainer": {
                        "ranks": 1,
                        "tokens_per_micro_batch": config["mb"],
                        "activation_checkpointing": ckpt,
                        "compile": bool(config["compile"]),
                        "sequence_tokens": run["seq_len"],
                    },
                    "step_gb": _pair(step / GB, round(config["peak_memory_gb"], 3)),
                }
            )
    return out


def _pair(estimate: float, measured: float | None) -> dict[str, float | None]:
    return {
        "estimate": round(estimate, 1),
        "measured": measured,
        "error": round(estimate / measured - 1, 3) if measured else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the rows here (JSON)")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {OUT.name} is stale")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    text = json.dumps({"model": "recipes/memory.py", "runs": rows()}, indent=1) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT.relative_to(ROOT)} is {'up to date' if same else 'stale'}")
        return 0 if same else 1
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
