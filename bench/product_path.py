"""The product path at full size on a GPU machine: real-size weights in, a trained model out.

For a catalog recipe (default qwen3-8b), on the GPUs of this machine:

1. write a Hugging Face folder with random weights of the recipe's real architecture (bf16
   safetensors in 5 GB shards, config, and the shipped character tokenizer sized to the
   vocabulary: no Hub here), as a download would leave it;
2. run A: `python -m runtime --recipe NAME --gpus N` with `layout.share=all` (the plan
   `forgesky plan NAME --gpus N --set layout.share=all` prints) and `model.hf_id` the folder:
   the trainer (FSDP over every GPU), reference and vLLM load it through the product's loading
   path; a few GRPO steps; a DCP checkpoint; kill -9 of every process of the run once that
   checkpoint is committed (the next step under way);
3. run B: the same command (with `--resume-gpus M`, on M GPUs: another number of trainer ranks,
   the checkpoint resharded as it loads) resumes from the checkpoint, trains to the end, writes
   its checkpoint and the model folder (RUN_DIR/model);
4. vLLM loads that folder and its prompt log-probs are compared with transformers' on the same
   folder; every tensor is compared with the initial weights (the trained model is not the
   input: the run's reward is `bench.rewards:distinct_share`, as the task's own is 0 for every
   completion of random weights and no weight would move).

GPU memory is sampled with nvidia-smi (every GPU, every 0.2 s, by phase) and set against the
plan's estimate per GPU; the trainer's own peaks by phase (start-up, step, publish, checkpoint,
export: CUDA allocator, rank 0) come from the run's metrics. Settings that differ from the
recipe (the prompts, lengths, steps, compile and CUDA graphs off for a short start-up) are
listed in the JSON. Output: a JSON under --out, the runs' logs beside it.

    python bench/product_path.py [--recipe qwen3-8b] [--gpus 2] [--resume-gpus 1] [--work /tmp/pp]
        [--out bench/results/product_path.json] [--set KEY=VALUE ...] [--make-room]

`--make-room` deletes run A's checkpoint once run B has resumed from it and trained a step
(for a disk that holds one checkpoint of the model: 12 bytes a parameter).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fault_runs import RuntimeRun, committed_steps, session_pids  # noqa: E402
from gpu_memory import GpuSampler, plan_gb_per_gpu, trainer_peaks  # noqa: E402

from runtime.control.metrics import read_metrics  # noqa: E402

SHORT = (
    "dataset.path=builtin:arith",  # GSM8K-shaped problems made locally (no Hub on the machine)
    # Random weights never answer right: the task's rewards would be 0 for every completion,
    # every advantage 0 and the exported model the input. This one varies between completions.
    # (math stays, weighted 0: the eval's reward must be one of the run's.)
    "dataset.rewards=[{name: math, weight: 0.0}, {name: 'bench.rewards:distinct_share', weight: 1.0}]",
    "eval.enabled=false",
    "grpo.max_response_tokens=128",
    "generator.enforce_eager=true",  # no CUDA graphs: start-up in seconds, not minutes
    "trainer.compile=false",
    "reference.compile=false",
)


def short(name: str) -> tuple[str, ...]:
    """SHORT for the recipe `name`: a reference in the trainer's processes (a LoRA run's, the
    base with the adapter off) runs the trainer's model, compiled as `trainer.compile` says, and
    refuses a setting of its own."""
    from recipes import load_recipe

    in_trainer = load_recipe(name).layout.reference.device == "trainer"
    return tuple(s for s in SHORT if not (in_trainer and s == "reference.compile=false"))


def versions() -> dict[str, str]:
    names = ("torch", "vllm", "torchmonarch", "torchstore", "torchtitan", "transformers")
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def write_random_model(
    recipe: Any, folder: Path, device: str = "cuda", tokenizer: Any = None
) -> dict[str, Any]:
    """An HF folder of the recipe's architecture with random bf16 weights (std 0.02, norms 1)
    and `tokenizer`, by default the arith character tokenizer sized to its vocabulary."""
    import torch

    from runtime.backends.build import model_spec
    from runtime.models.export import write_hf_model
    from runtime.models.hf import build_hf_model
    from runtime.tasks.arith.tokenization import build_tokenizer

    start = time.perf_counter()
    spec = model_spec(recipe)
    with torch.device("meta"):
        shapes = build_hf_model(spec, dtype=torch.bfloat16, device="meta").state_dict()
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, t in shapes.items():
        if t.dim() == 1:
            weights[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            r = torch.randn(t.shape, generator=gen, device=device, dtype=torch.bfloat16)
            weights[name] = (r * 0.02).cpu()
    tokenizer = build_tokenizer(spec.vocab_size) if tokenizer is None else tokenizer
    write_hf_model(weights, spec, folder, tokenizer=tokenizer)
    if spec.tie_embeddings:
        weights.pop("lm_head.weight", None)  # one tensor in the files
    params = sum(t.numel() for t in weights.values())
    return {
        "params_in_files": params,
        "bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
        "seconds": round(time.perf_counter() - start, 1),
    }


def random_model_once(
    recipe: Any, folder: Path, device: str = "cuda", tokenizer: Any = None
) -> dict[str, Any]:
    """`write_random_model`'s folder, written once: kept while its stamp (bench_model.json)
    names the recipe's family, size and vocabulary. What the folder holds, and whether this
    call wrote it (`written_now`)."""
    held = held_model(recipe, folder)
    if held is not None:
        return held
    info = write_random_model(recipe, folder, device=device, tokenizer=tokenizer)
    (folder / STAMP).write_text(json.dumps({"key": _model_key(recipe), **info}) + "\n")
    return {**info, "written_now": True}


STAMP = "bench_model.json"


def _model_key(recipe: Any) -> dict[str, Any]:
    return {
        "family": recipe.model.family,
        "size": recipe.model.size,
        "vocab": recipe.arch.vocab_size,
    }


def held_model(recipe: Any, folder: Path) -> dict[str, Any] | None:
    """What `folder` holds where `random_model_once` wrote it for the recipe's architecture
    (`written_now` false), else None: a check without torch or a GPU."""
    stamp = folder / STAMP
    if not stamp.is_file():
        return None
    held = json.loads(stamp.read_text())
    if held.get("key") != _model_key(recipe):
        return None
    return {**{k: v for k, v in held.items() if k != "key"}, "written_now": False}


def runtime_args(name: str, gpus: int, folder: Path, run_dir: Path, sets: list[str]) -> list[str]:
    """`sets`: the bench's settings after `layout.share` and the model folder (`short(name)`
    and the caller's)."""
    args = ["--recipe", name, "--gpus", str(gpus), "--run-dir", str(run_dir)]
    for s in ("layout.share=all", f"model.hf_id={folder}", *sets):
        args += ["--set", s]
    return args


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    return read_metrics(run_dir / "metrics.jsonl")


def memory_by_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step's trainer memory records (rank 0's peaks so far, what stayed allocated after
    each phase, the largest over ranks): growth from step to step is a leak, not a peak."""
    return [
        {"step": r["step"], **{k: v for k, v in r.items() if k.startswith("memory/")}} for r in rows
    ]


def step_times(rows: list[dict[str, Any]], after: int = 0) -> list[dict[str, Any]]:
    """The seconds of each step past `after`: the step, its training, and what the checkpoint
    before it held up: the loop (`time/checkpoint_stall_s`: settling the generation in flight)
    and the optimizer step (`time/checkpoint_staging_wait_s`: the state's copy to host memory
    still going); and what the step trained on (its response tokens, their mean length), which
    a step's memory peak depends on."""
    keys = (
        "time/step_s",
        "time/train_s",
        "time/checkpoint_stall_s",
        "time/checkpoint_staging_wait_s",
        "response_tokens",
        "response/len_mean",
    )
    return [
        {"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows if r["step"] > after
    ]


def resumed_step(line: str | None) -> int:
    """The step of a `resumed from step N (...)` line (0 without one)."""
    found = re.match(r"resumed from step (\d+)", line or "")
    return int(found.group(1)) if found else 0


def plan_summary(p: Any) -> dict[str, Any]:
    """What the JSON keeps of a plan: its table, and its GB per service and per GPU."""
    return {
        "describe": p.describe(),
        "gb_per_gpu_by_service": p.memory,
        "estimated_gb_per_gpu": plan_gb_per_gpu(p),
    }


def trainer_line(output: str) -> str | None:
    """The run's `trainer: BACKEND on N ranks, ...` line (its ranks, micro-batch)."""
    return next((x for x in output.splitlines() if x.startswith("trainer: ")), None)


def gpu_processes() -> str:
    """nvidia-smi's compute processes (pid, name, GPU memory): who holds what when a run is
    stuck."""
    query = "--query-compute-apps=gpu_uuid,pid,process_name,used_memory"
    done = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
    )
    return done.stdout.strip() or done.stderr.strip()


def gpus_free(sampler: GpuSampler, limit_gb: float = 1.5, timeout: float = 60.0) -> float:
    """Seconds until every GPU's used memory is below `limit_gb` (nothing left of the run)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if all(gb < limit_gb for gb in sampler.used().values()):
            return round(time.monotonic() - start, 2)
        time.sleep(0.2)
    raise AssertionError(f"GPU memory still held {timeout:g} s after the run: {sampler.used()}")


def run_a(
    args: list[str], run_dir: Path, log: Path, every: int, silence_s: float = 240.0
) -> dict[str, Any]:
    """Until checkpoint `every` is committed, then kill -9 every process of the run. A run
    that prints nothing for `silence_s` once ready is stuck: its stacks go to its log."""
    run = RuntimeRun(args, log=log)
    try:
        run.wait_line(r"services ready", timeout=900)
        ready_s = time.monotonic() - run.started
        deadline = time.monotonic() + 900
        while every not in committed_steps(run_dir):
            if run.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no committed checkpoint {every}:\n{run.output}")
            if time.monotonic() - run.last_line_at > silence_s:
                raise AssertionError(f"run A printed nothing for {silence_s:g} s")
            time.sleep(0.1)
        committed_s = time.monotonic() - run.started
        steps_logged = [r["step"] for r in step_rows(run_dir)]
        killed = time.monotonic()
        run.kill()
        kill_s = time.monotonic() - killed
    except BaseException:
        if run.proc.poll() is None:
            print(f"run A stuck; GPU memory by process:\n{gpu_processes()}", flush=True)
            print(f"run A stuck: stacks of {run.dump_stacks()} in its log", flush=True)
        raise
    finally:
        if run.proc.poll() is None:
            run.kill()
    left = session_pids(run.proc.pid)
    assert not left, f"processes of run A left after kill -9: {left}"
    return {
        "trainer": trainer_line(run.output),
        "services_ready_s": round(ready_s, 1),
        "checkpoint_committed_s": round(committed_s, 1),
        "steps_logged_at_kill": steps_logged,
        "kill_s": round(kill_s, 2),
    }


def run_b(args: list[str], run_dir: Path, log: Path, every: int, make_room: bool) -> dict[str, Any]:
    """The same command: resumes from checkpoint `every`, runs to the end, exports."""
    run = RuntimeRun(args, log=log)
    removed = None
    try:
        resumed = run.wait_line(r"^resumed from step", timeout=900)
        if make_room:
            # The state is read once "resumed from step" is printed: the disk gets its room
            # back before the next write starts.
            old = run_dir / "checkpoints" / f"step_{every:06d}"
            shutil.rmtree(old)
            removed = old.name
        code = run.finish(timeout=1200)
    except BaseException:
        if run.proc.poll() is None:
            print(f"run B stuck; GPU memory by process:\n{gpu_processes()}", flush=True)
            print(f"run B stuck: stacks of {run.dump_stacks()} in its log", flush=True)
        raise
    finally:
        if run.proc.poll() is None:
            run.kill()
    assert code == 0, f"run B exited {code}:\n{run.output[-4000:]}"
    assert wrote_model(run.output, run_dir), run.output[-4000:]
    left = session_pids(run.proc.pid)
    assert not left, f"processes of run B left: {left}"
    return {
        "trainer": trainer_line(run.output),
        "resumed": resumed.strip(),
        "seconds": round(time.monotonic() - run.started, 1),
        "exit_code": code,
        "checkpoint_removed_to_make_room": removed,
    }


def wrote_model(output: str, run_dir: Path) -> bool:
    """Whether a run's output says it wrote RUN_DIR/model: a full model, or a LoRA run's adapter
    (the line `runtime.control.run` prints for each)."""
    said = (
        line.split(" -> ", 1)[1].partition(" (")[0]
        for line in output.splitlines()
        if line.startswith(("model -> ", "adapter -> "))
    )
    return any(Path(path).resolve() == (run_dir / "model").resolve() for path in said)


def servable(run_dir: Path) -> tuple[Path, dict[str, Any] | None]:
    """The run's model folder as vLLM and transformers load it: a LoRA run's (an adapter) goes
    through `forgesky export RUN_DIR --merge` into RUN_DIR/merged first, as a user serving it
    whole would; with what the merge took."""
    model = run_dir / "model"
    if not (model / "adapter_config.json").exists():
        return model, None
    merged = run_dir / "merged"
    start = time.perf_counter()
    cli = "import sys; from launcher.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["export", str(run_dir), "--out", str(merged), "--merge"]
    done = subprocess.run(
        [sys.executable, "-c", cli, *argv], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise AssertionError(f"forgesky export --merge failed:\n{done.stdout}{done.stderr}")
    return merged, {"seconds": round(time.perf_counter() - start, 1), "folder": str(merged)}


def serve_export(model: Path, initial: Path) -> dict[str, Any]:
    """vLLM on GPU 0 and transformers on GPU 1 (or 0) score the same token rows from the
    exported folder, which is compared with the initial folder element for element."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    # the weights and room for a small cache: 0.4 of an H200 holds 8B, not 32B (65 GB)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    share = (weights + 16e9) / torch.cuda.get_device_properties(0).total_memory
    llm = LLM(
        model=str(model),
        gpu_memory_utilization=min(0.9, max(0.4, share)),
        enforce_eager=True,
        max_model_len=512,
        dtype="bfloat16",
        seed=0,
    )
    loaded_s = time.perf_counter() - start
    config = json.loads((model / "config.json").read_text())
    gen = torch.Generator().manual_seed(1)
    rows = [
        torch.randint(3, min(config["vocab_size"], 100), (64,), generator=gen).tolist()
        for _ in range(8)
    ]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], params)
    vllm_lp = [
        [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], r[1:], strict=True)]
        for o, r in zip(outs, rows, strict=True)
    ]
    del llm
    hf_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(hf_device).eval()
    diffs = []
    with torch.no_grad():
        for row, lps in zip(rows, vllm_lp, strict=True):
            ids = torch.tensor([row], device=hf_device)
            logits = hf(ids).logits.float()
            lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            diffs += (lp.cpu() - torch.tensor(lps)).abs().tolist()
    return {
        "vllm_load_s": round(loaded_s, 1),
        "rows": len(rows),
        **logprob_diffs(diffs),
        **changed_share(model, initial),
    }


def logprob_diffs(diffs: list[float]) -> dict[str, float]:
    """Mean, 99th percentile and largest of the absolute log-prob differences (one a token)."""
    ranked = sorted(diffs)
    return {
        "tokens_compared": len(ranked),
        "mean_abs_logprob_diff_vllm_vs_transformers": round(sum(ranked) / len(ranked), 4),
        "p99_abs_logprob_diff": round(ranked[round(0.99 * (len(ranked) - 1))], 4),
        "max_abs_logprob_diff": round(ranked[-1], 4),
    }


def changed_share(model: Path, initial: Path) -> dict[str, Any]:
    """How much of the exported model differs from the initial folder (bf16 as both are stored):
    the share of elements changed over every tensor, and the largest change."""
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, tuple[Path, str]]:
        where = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                where.update({k: (file, k) for k in f.keys()})  # noqa: SIM118
        return where

    def load(where: tuple[Path, str]) -> Any:
        with safe_open(where[0], "pt") as f:
            return f.get_tensor(where[1]).float()

    ours, theirs = tensors(model), tensors(initial)
    changed = total = 0
    largest = 0.0
    for name in sorted(ours.keys() & theirs.keys()):
        diff = (load(ours[name]) - load(theirs[name])).abs()
        changed += int((diff > 0).sum())
        total += diff.numel()
        largest = max(largest, float(diff.max()))
    return {
        "tensors_compared": len(ours.keys() & theirs.keys()),
        "elements_changed_share": round(changed / max(total, 1), 6),
        "max_abs_change_vs_initial": largest,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="qwen3-8b")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument(
        "--resume-gpus",
        type=int,
        default=None,
        help="run B's GPU count (default --gpus): another number of trainer ranks resumes run "
        "A's checkpoint, resharded",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--every", type=int, default=2, help="the checkpoint run A is killed after")
    p.add_argument("--work", default="/tmp/product_path")
    p.add_argument(
        "--model-dir",
        default=None,
        help="where the initial HF folder goes (default: in --work; e.g. /dev/shm to keep the "
        "disk for checkpoints)",
    )
    p.add_argument(
        "--checkpoints-dir",
        default=None,
        help="where the run's checkpoints go (RUN_DIR/checkpoints becomes a link to it; e.g. "
        "--work on /dev/shm for the exports, the checkpoints on the disk)",
    )
    p.add_argument("--out", default="bench/results/product_path.json")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--make-room", action="store_true")
    p.add_argument(
        "--part",
        choices=["all", "a", "b"],
        default="all",
        help="a: the model and run A; b: run B and serving, from part a's state in --work "
        "(two calls of a machine with a per-command time limit)",
    )
    p.add_argument("--write-model", default=None, help=argparse.SUPPRESS)  # the child's job
    a = p.parse_args(argv)
    # A time limit from outside (`timeout`) ends the bench through its `finally`s: the run's
    # processes are killed and the JSON so far is written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from recipes import apply_overrides, load_recipe, plan
    from runtime.backends.build import model_spec

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent
    folder = Path(a.model_dir) if a.model_dir else work / f"{a.recipe}-hf"
    run_dir = work / f"{a.recipe}-run"
    # the bench's settings (SHORT as the recipe takes them), then the caller's
    sets = [
        *short(a.recipe),
        *a.sets,
        f"grpo.steps={a.steps}",
        f"grpo.checkpoint_interval={a.every}",
    ]
    resume_gpus = a.resume_gpus or a.gpus
    result: dict[str, Any] = {
        "recipe": a.recipe,
        "gpus": a.gpus,
        "resume_gpus": resume_gpus,
        "device": subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[:1],
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
        "settings_changed": [
            "layout.share=all",
            "model.hf_id=<random HF folder>",
            *sets,
        ],
    }
    if a.checkpoints_dir:
        result["checkpoints_dir"] = a.checkpoints_dir
    accelerator = "H200" if "H200" in str(result["device"]) else "H100"
    recipe = apply_overrides(
        load_recipe(a.recipe),
        ["layout.share=all", f"model.hf_id={folder}", *sets],
    )
    if a.write_model:  # in a child process: its CUDA context ends with it
        info = random_model_once(recipe, Path(a.write_model))
        print(json.dumps(info), flush=True)
        return 0
    the_plan = plan(recipe, a.gpus, accelerator=accelerator)
    result["plan"] = {**plan_summary(the_plan), "params": model_spec(recipe).num_params()}
    print(the_plan.describe(), flush=True)
    state = work / f"{a.recipe}-state.json"
    if a.part == "b":
        result = json.loads(state.read_text())
    args = runtime_args(a.recipe, a.gpus, folder, run_dir, sets)
    args_b = runtime_args(a.recipe, resume_gpus, folder, run_dir, sets)
    if resume_gpus != a.gpus:
        plan_b = plan(recipe, resume_gpus, accelerator=accelerator)
        result["plan_b"] = plan_summary(plan_b)
        print(plan_b.describe(), flush=True)
    sampler = GpuSampler()
    try:
        if a.part in ("all", "a"):
            part_a(a, result, sampler, folder, run_dir, args, logs)
        if a.part in ("all", "b"):
            part_b(a, result, sampler, folder, run_dir, args_b, logs)
    finally:
        sampler.stop()
        peaks = result.setdefault("gpu_used_peak_gb", {})
        for phase, gpus in sampler.peaks.items():
            peaks[phase] = {str(g): v for g, v in sorted(gpus.items())}
        if (run_dir / "metrics.jsonl").exists():  # also of a run that stopped or got stuck
            rows = step_rows(run_dir)
            result["trainer_memory_by_step"] = memory_by_step(rows)
            # by the run that logged them last: run B's own steps are those past its checkpoint
            if "run_b" in result:
                times = step_times(rows, resumed_step(result["run_b"].get("resumed")))
                result.setdefault("step_times", {})["run B"] = times
            else:  # run A stopped before its own summary
                result.setdefault("step_times", {}).setdefault("run A", step_times(rows))
        state.write_text(json.dumps(result, indent=2) + "\n")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["gpu_used_peak_gb"]), flush=True)
    return 0


def place_checkpoints(run_dir: Path, where: Path) -> None:
    """RUN_DIR/checkpoints as a link to an empty `where` (on another filesystem)."""
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to(where, target_is_directory=True)


def part_a(
    a: Any,
    result: dict[str, Any],
    sampler: GpuSampler,
    folder: Path,
    run_dir: Path,
    args: list[str],
    logs: Path,
) -> None:
    """The initial model (unless written before) and run A, killed after its checkpoint."""
    sampler.phase = "write model"
    if not (folder / "config.json").exists():
        child = [sys.executable, __file__, "--recipe", a.recipe, "--work", a.work]
        child += [x for s in a.sets for x in ("--set", s)] + ["--write-model", str(folder)]
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode != 0:
            raise AssertionError(f"writing the model failed:\n{done.stdout}{done.stderr}")
        result["initial_model"] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"initial model: {result['initial_model']}", flush=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    if a.checkpoints_dir:
        place_checkpoints(run_dir, Path(a.checkpoints_dir))
    sampler.phase = "run A"
    result["run_a"] = run_a(args, run_dir, logs / f"product_path_{a.recipe}_run_a.log", a.every)
    result["run_a"]["gpus_free_after_kill_s"] = gpus_free(sampler)
    rows = step_rows(run_dir)  # now, before run B appends its own to the same metrics file
    result["run_a"]["trainer_memory"] = trainer_peaks(rows)
    result.setdefault("step_times", {})["run A"] = step_times(rows)
    print(f"run A: {result['run_a']}", flush=True)


def part_b(
    a: Any,
    result: dict[str, Any],
    sampler: GpuSampler,
    folder: Path,
    run_dir: Path,
    args: list[str],
    logs: Path,
) -> None:
    """Run B (resume, train to the end, export), then vLLM serves the export."""
    sampler.phase = "run B"
    result["run_b"] = run_b(
        args, run_dir, logs / f"product_path_{a.recipe}_run_b.log", a.every, a.make_room
    )
    result["run_b"]["gpus_free_after_s"] = gpus_free(sampler)
    rows = step_rows(run_dir)
    result["steps"] = [
        {k: r.get(k) for k in ("step", "time/step_s", "time/train_s", "loss", "kl")} for r in rows
    ]
    result["run_b"]["trainer_memory"] = trainer_peaks([r for r in rows if r["step"] > a.every])
    result["model_files"] = sorted(p.name for p in (run_dir / "model").iterdir())
    print(f"run B: {result['run_b']}", flush=True)
    sampler.phase = "serve export"
    served, merged = servable(run_dir)
    if merged is not None:
        result["merge"] = merged
        print(f"merged: {merged}", flush=True)
    result["serve"] = serve_export(served, folder)
    print(f"serve: {result['serve']}", flush=True)
    if result["serve"]["elements_changed_share"] == 0.0:
        raise AssertionError("the exported model is the initial one, element for element")


if __name__ == "__main__":
    sys.exit(main())
