"""GPU throughput of a real recipe with random weights: the whole GRPO loop, and vLLM alone.

    python bench/gpu_grpo.py grpo [--recipe qwen3-1.7b] [--steps 8] [--response-tokens 512] [--prompt-tokens N] [--model-folder DIR]
    python bench/gpu_grpo.py vllm [--recipe qwen3-1.7b] [--response-tokens 512] [--cpus SPEC] [--cpu-sweep] [--speed-probe]

`grpo` runs the recipe through the runtime (`runtime.control.run.run`, what `python -m runtime` calls
after parsing) with `model.init=random` (or, `--model-folder`, random weights in a Hugging Face
folder read as a user's model is) and the Hub-free `builtin:arith` prompts and tokenizer,
then reads metrics.jsonl: samples/s per GPU, step time, in-loop generation tokens/s, weight-sync
seconds and GB/s, trainer tokens/s and MFU (model FLOPs per trainer GPU-second over peak bf16:
`training_flops`, attention included, the output projection on response positions only, as the
trainer computes it), and the generator's idle share (1 - generating seconds / wall seconds over
the measured steps).
The layout is the one `forgesky plan NAME --gpus N` prints for the GPU found (layout.share auto:
the fastest the cost model predicts; `--set layout.share=...` for another), its settings
planned as for any run; the JSON lists what `--set` changed by hand, the planner's predicted
step at the run's measured lengths and the measured step over it.

`vllm` runs the same prompts and sampling through a `VLLMGenerator` alone on the GPU: the
throughput the loop's generation is compared with, a 512-sequence point, and the in-engine
weight-load rate. `--engine` puts vLLM's engine core in this process (as the generator runs it by
default) or in a process of its own (vLLM's default; `--set generator.engine=separate` does the
same for `grpo`'s generator); both sections record which ran (`engine`), and a GRPO section's
ratio to vLLM alone names the engine alone ran (`standalone_engine`). Each timed call is
listed (`calls_list`: seconds, tokens, the engine thread's CPU seconds and switches, the CPUs it
was seen on every 50 ms), beside the host's CPU layout (`cpu_placement`: SMT siblings, NUMA
nodes, the GPU's node, the process's CPUs); `--cpus` pins the process before the engine starts
(runtime/procs/cpus.py's words or a list), `--cpu-sweep` adds one call with the engine's thread
pinned to each CPU in turn (`cpu_sweep`), each call's garbage-collection seconds (`gc_s`) and,
with `--speed-probe`, a CPU's pace meanwhile (`probe_mb_per_s`: SHA-256 of a fixed buffer in a
process of its own, on another CPU than the engine's), `--calls-only` keeps only the timed calls
(`device_run.sh cpus` runs several such processes; bench/cpu_runs.py tabulates them).

`train` times the trainer alone (`FSDPTrainer.train_step`, the GRPO loss, random weights and
tokens) on `--sequences` sequences of `--seq-len` tokens (the last `--response-share` of each is
response), for each `--config` (`ac=0|1,compile=0|1,mb=TOKENS,head=0|1`: activation
checkpointing, torch.compile per block, tokens per micro-batch, and whether the compiled run
compiles the output projection's log-softmax too): tokens/s, MFU (as above, and without
attention's FLOPs) and peak memory; `--profile` adds one step under torch.profiler, its GPU time
by kind of kernel and the share of the step no kernel ran.

Every mode merges its section into one JSON (`--out`), with device and versions; `vllm` also
writes the in-loop/standalone generation ratio when `grpo` ran first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_memory import GpuSampler, plan_gb_per_gpu, trainer_peaks  # noqa: E402
from stacks import StackRecorder  # noqa: E402

from runtime.procs import cpus as cpu_layout  # noqa: E402
from runtime.procs.usage import thread_usage  # noqa: E402

OFFLINE = ["model.init=random", "model.tokenizer=builtin:arith", "dataset.path=builtin:arith"]


def offline(model_folder: str | None = None) -> list[str]:
    """The bench's Hub-free overrides: the built-in prompts and tokenizer, and random weights,
    by TorchTitan's seeded init (`model.init=random`) or from a Hugging Face folder of random
    weights read as a user's model is (`model.hf_id=FOLDER`, `--model-folder`)."""
    if model_folder is None:
        return list(OFFLINE)
    return [f"model.hf_id={model_folder}", *OFFLINE[1:]]


# throughput runs of random weights: the recipes' held-out evaluation would measure nothing
NO_EVAL = ["eval.enabled=false"]
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s (SXM)


STACK = ("torch", "vllm", "torchmonarch", "torchstore", "torchtitan", "transformers")


def versions(dists: tuple[str, ...] = STACK) -> dict[str, str]:
    """Python's and each distribution's version ("absent" where it is not installed)."""
    out = {"python": platform.python_version()}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def gpu_info() -> dict[str, Any]:
    query = "--query-gpu=name,memory.total,driver_version"
    try:
        lines = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        lines = ""
    gpus = [line.split(", ") for line in lines.splitlines() if line]
    name = gpus[0][0] if gpus else "unknown"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return {"gpus": len(gpus), "name": name, "memory": gpus[0][1] if gpus else None,
            "driver": gpus[0][2] if gpus else None, "peak_bf16_flops": peak}  # fmt: skip


def gpu_bus_id() -> str | None:
    """The PCI bus id of the first GPU this process sees (CUDA_VISIBLE_DEVICES' first, as
    nvidia-smi numbers them), None where nvidia-smi does not answer."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", first, "--query-gpu=pci.bus_id", "--format=csv,noheader"],
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    except OSError:
        return None
    return out.splitlines()[0] if out else None


def cpu_placement(spec: str | None) -> dict[str, Any]:
    """The host's CPU layout (SMT siblings, NUMA nodes, the GPU's node) and this process's
    CPUs; with `spec` (`--cpus`: cpus.resolve's words or a list) the process pinned to them
    first, before any engine starts (its threads and processes inherit the set)."""
    topo = cpu_layout.topology(gpu_bus_id=gpu_bus_id())
    allowed = sorted(os.sched_getaffinity(0))
    try:
        chosen = cpu_layout.resolve(spec or "none", topo, allowed)
    except ValueError as e:
        print(f"gpu_grpo.py: --{e}", file=sys.stderr)
        sys.exit(2)
    if chosen is not None:
        cpu_layout.pin_process(chosen)
    return {
        "topology": topo.to_dict(),
        # fixed for the process as it starts: its string hashes' seed (random where unset)
        "python_hash_seed": os.environ.get("PYTHONHASHSEED", "random"),
        "cpus_spec": spec or "none",
        "affinity": cpu_layout.format_cpu_list(sorted(os.sched_getaffinity(0))),
    }


def engine_threads(in_process: bool) -> list[tuple[int | str, int]]:
    """(pid, tid) of the thread(s) that run vLLM's engine steps: the caller's with the engine
    core in this process; else the main thread of each engine core process below this one."""
    if in_process:
        return [("self", threading.get_native_id())]
    import psutil

    children = psutil.Process().children(recursive=True)
    cores = [c for c in children if "EngineCor" in c.name()] or children
    return [(c.pid, c.pid) for c in cores]


def load(
    recipe_name: str,
    steps: int,
    response_tokens: int | None,
    extra: list[str] | None = None,
    prompt_tokens_mean: int | None = None,
    model_folder: str | None = None,
) -> Any:
    from recipes import apply_overrides, load_recipe

    overrides = [
        *offline(model_folder),
        *NO_EVAL,
        f"grpo.steps={steps}",
        "grpo.checkpoint_interval=0",
    ]
    if response_tokens:
        overrides.append(f"grpo.max_response_tokens={response_tokens}")
    recipe = apply_overrides(load_recipe(recipe_name), [*overrides, *(extra or [])])
    if prompt_tokens_mean:
        recipe = apply_overrides(recipe, [longer_prompts(recipe, prompt_tokens_mean)])
    return recipe


# Printable ASCII: the arith tokenizer's characters, one token each.
FILLER = "Background notes, read them and then answer the question that follows. "


def longer_prompts(recipe: Any, mean_tokens: int) -> str:
    """The `dataset.prompt_template` override that lengthens the arith prompts to about
    `mean_tokens` tokens on average: the recipe's template after a fixed filler of the missing
    length (one token a character with the arith tokenizer). Prompts past the recipe's
    `grpo.max_prompt_tokens` are cut from the left, as the generator cuts them."""
    if mean_tokens > recipe.grpo.max_prompt_tokens:
        raise SystemExit(
            f"--prompt-tokens {mean_tokens} is over the recipe's grpo.max_prompt_tokens "
            f"({recipe.grpo.max_prompt_tokens}); raise it with --set"
        )
    have = mean([len(p) for p in prompt_tokens(recipe, count=64)]) or 0.0
    need = round(mean_tokens - have)
    if need <= 0:
        raise SystemExit(f"--prompt-tokens {mean_tokens}: the prompts average {have:.0f} already")
    filler = (FILLER * (need // len(FILLER) + 1))[:need]
    # a string setting takes the text after "=" as typed (recipes/loader.py)
    return "dataset.prompt_template=" + filler + recipe.dataset.prompt_template


def prompt_tokens(recipe: Any, count: int = 512) -> list[list[int]]:
    """The first `count` prompts of the run, encoded as the generator actor encodes them."""
    from runtime.backends import build as services
    from runtime.tasks.data import build_prompt_source

    tokenizer = services.load_tokenizer(recipe)
    source = build_prompt_source(recipe.dataset, seed=recipe.grpo.seed)
    encoded = []
    for p in source.take(count):
        text = "\n".join(m["content"] for m in p.messages())
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        encoded.append(ids[-recipe.grpo.max_prompt_tokens :])
    return encoded


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def per(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing (a failed or short run)."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


class StepWindow:
    """Opens the sampler's clock window once a run's metrics file holds `first` records and
    closes it at `last` (the measured steps), watching the file from a thread of its own; a
    `recorder` (bench/stacks.py) records the run's stacks from `stacks_from` records to `last`."""

    def __init__(
        self,
        sampler: GpuSampler,
        metrics: Path,
        first: int,
        last: int,
        name: str,
        recorder: StackRecorder | None = None,
        stacks_from: int | None = None,
    ):
        self.sampler, self.metrics, self.first, self.last, self.name = (
            sampler, metrics, first, last, name
        )  # fmt: skip
        self.recorder = recorder
        self.stacks_from = first if stacks_from is None else stacks_from
        self._recording = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(0.1):
            try:
                lines = self.metrics.read_bytes().count(b"\n")
            except OSError:
                continue
            self.sampler.clock_window = self.name if self.first <= lines < self.last else None
            if self.recorder is not None:
                if not self._recording and self.stacks_from <= lines < self.last:
                    self._recording = True
                    self.recorder.start(os.getpid())
                elif self._recording and lines >= self.last:
                    self.recorder.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sampler.clock_window = None
        if self.recorder is not None:
            self.recorder.stop()


def engine_thread(rows: list[dict[str, Any]], prefix: str = "") -> dict[str, float | None]:
    """Means of a generate call's engine-thread figures over `rows` (records or alone's calls)."""
    return {
        f"engine_thread_{name}": mean([r[prefix + name] for r in rows if prefix + name in r])
        for name in ("cpu_s", "voluntary_switches", "involuntary_switches")
    }


def model_folder(recipe_name: str, folder: Path, device: str = "cuda") -> dict[str, Any]:
    """A Hugging Face folder of the recipe's architecture with random bf16 weights and the
    arith tokenizer (bench/product_path.py), written once in a process of its own (its CUDA
    context ends with it) and kept while its stamp names the same architecture: the weights
    then reach the trainer and the generators as a user's model does. Under LoRA that matters
    to the start: with `model.init=random` each generator builds the trainer's seeded init on
    the host and writes it out for vLLM before its engine starts (qwen3-8b-lora: the
    generator ready at 222 s, the trainer at 87 s), where from a folder vLLM reads the base
    itself beside the trainer's load. A folder already written is read from its stamp here,
    without the child."""
    from product_path import held_model

    from recipes import load_recipe

    held = held_model(load_recipe(recipe_name), folder)
    if held is not None:
        return {"path": str(folder.resolve()), **held}
    cmd = [sys.executable, str(Path(__file__).resolve()), "write-model", "--recipe", recipe_name]
    cmd += ["--model-folder", str(folder), "--device", device]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"writing the model folder {folder} failed:\n{done.stdout}{done.stderr}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    return {"path": str(folder.resolve()), **info}


def run_grpo(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe through the runtime on the plan `forgesky plan NAME --gpus N` gives (the
    same `plan()` `python -m runtime` calls), with only the bench's overrides (random weights,
    built-in prompts, the response length, the steps) and the caller's `--set`."""
    import torch

    from recipes import plan
    from runtime.control.config import RunConfig
    from runtime.control.run import run

    gpus = args.gpus or torch.cuda.device_count()
    folder = model_folder(args.recipe, Path(args.model_folder)) if args.model_folder else None
    recipe = load(
        args.recipe,
        args.steps,
        args.response_tokens,
        list(args.set or []),
        args.prompt_tokens,
        model_folder=folder and folder["path"],
    )
    accelerator = "H200" if "H200" in gpu_info()["name"] else "H100"
    run_plan = plan(recipe, gpus, accelerator=accelerator)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="forgesky-gpu-bench-"))
    sampler = GpuSampler()
    sampler.phase = "run"
    metrics = run_dir / "metrics.jsonl"
    # the GPUs' clocks over the measured steps: from the warm-up's last record to the last step's
    recorder = stack_recorder(args, "grpo")
    stacks_from = args.warmup if args.py_spy_from is None else args.py_spy_from
    window = StepWindow(
        sampler, metrics, args.warmup, args.steps, "measured", recorder, stacks_from
    )
    start = time.perf_counter()
    try:
        code = run(RunConfig(recipe=recipe, plan=run_plan, run_dir=run_dir))
        wall = time.perf_counter() - start
        records = (
            [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        )
        written = written_gb(run_dir)
        profiles = run_profiles(run_dir)
        # the run's own summary: its wall time on the nodes beside the plan's prediction of it
        done = run_dir / "summary.json"
        run_summary = json.loads(done.read_text()) if done.exists() else None
    finally:
        window.stop()
        sampler.stop()
        if not args.run_dir:
            # Its checkpoint and exported model (12 + 2 bytes a parameter) would fill the disk
            # of a machine that runs a few of these; what the bench reads is in `records`.
            shutil.rmtree(run_dir, ignore_errors=True)
    prompts = prompt_tokens(recipe)
    summary = summarize(
        recipe, run_plan, records, args.warmup, prompts, gpu_info()["peak_bf16_flops"]
    )
    return {
        "exit_code": code,
        "share": run_plan.share,
        "wall_s": wall,
        "run_summary": run_summary,
        "set_by_hand": list(args.set or []),
        "prompt_tokens_asked": args.prompt_tokens,
        # the weights: TorchTitan's seeded init, or a random Hugging Face folder (--model-folder)
        "model_folder": folder,
        # where vLLM's engine core ran: in the generator's process or one of its own
        "engine": run_plan.settings.generator.engine,
        **written,
        "settings": run_plan.settings.to_dict(),
        **prediction(recipe, run_plan, summary),
        **summary,
        "memory": memory_against_plan(run_plan, records, sampler.peaks.get("run", {})),
        "gpu_clocks": sampler.clocks(),
        "host_cpu": sampler.host_cpu(),
        **stacks(recorder, stacks_from),
        **({"profiles": profiles} if profiles else {}),
    }


def run_profiles(run_dir: Path) -> dict[str, Any]:
    """The summaries a run's `trainer.profile_step` left in RUN_DIR/profile (by file name), read
    before the bench deletes the run's folder."""
    folder = run_dir / "profile"
    if not folder.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def written_gb(run_dir: Path) -> dict[str, float | None]:
    """GB on disk of the run's last checkpoint and of its model folder (a LoRA run: the
    adapter), None where the run wrote none."""

    def size(path: Path) -> float | None:
        files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else []
        return round(sum(f.stat().st_size for f in files) / 1e9, 4) if files else None

    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    return {
        "checkpoint_gb": size(steps[-1]) if steps else None,
        "model_gb": size(run_dir / "model"),
    }


def stack_recorder(args: argparse.Namespace, mode: str) -> StackRecorder | None:
    """With `--py-spy DIR`: a recorder of the run's stacks (raw file in DIR)."""
    if not args.py_spy:
        return None
    return StackRecorder(Path(args.py_spy) / f"stacks_{mode}{args.tag}.txt.gz")


def stacks(recorder: StackRecorder | None, first: int | None = None) -> dict[str, Any]:
    if recorder is None:
        return {}
    return {"stacks": {**({} if first is None else {"from_record": first}), **recorder.summary()}}


def memory_against_plan(
    run_plan: Any, records: list[dict[str, Any]], used: dict[int, float]
) -> dict[str, Any]:
    """The plan's estimate per GPU (its services' GB/GPU added up where they share one) beside
    what the run used: nvidia-smi's peak per GPU (every process, caches included) and the
    trainer's own allocator peaks by phase (rank 0; `memory/*` in its records)."""
    return {
        "plan_gb_by_service": dict(run_plan.memory),
        "plan_trainer_peak_gb": run_plan.settings.trainer.peak_gb,
        "plan_gb_per_gpu": plan_gb_per_gpu(run_plan),
        "nvidia_smi_peak_gb_per_gpu": {str(g): v for g, v in sorted(used.items())},
        "trainer_allocator_peak_gb": trainer_peaks(records),
    }


def prediction(recipe: Any, run_plan: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """The planner's predicted step at the run's measured lengths, and the measured one over it
    (the check of recipes/costs.py), with the layouts the planner weighed."""
    from recipes.gpu_plan import predict_layout

    if not summary.get("step_s"):
        return {}
    estimate = predict_layout(
        recipe,
        run_plan.accelerator,
        run_plan.placements,
        run_plan.settings,
        summary["prompt_tokens_mean"],
        summary["response_tokens_mean"],
    )
    return {
        "predicted_step_s": round(estimate.seconds, 3),
        "measured_over_predicted": round(summary["step_s"] / estimate.seconds, 3),
        "predicted_bound_by": estimate.bound_by,
        "candidates": [dataclasses.asdict(c) for c in run_plan.candidates],
    }


def idle_share(
    measured: list[dict[str, Any]], generate_s: float | None, step_s: float | None
) -> float | None:
    """1 - the generators' busy share: the controller's count when the records have it (every
    generate call of a step, all replicas), else one call's time per step (older runs).

    Generating seconds over wall seconds of all measured steps together: a call is counted in
    the step it ends in, so single steps read 0 or over 1, and a mean of per-step shares would
    weigh a short step like a long one."""
    if measured and all("generator/busy_share" in r for r in measured):
        wall = sum(r["time/step_s"] for r in measured)
        busy = sum(r["generator/busy_share"] * r["time/step_s"] for r in measured)
        return 1 - busy / wall if wall > 0 else None
    if generate_s is None or not step_s:
        return None
    return max(0.0, 1 - generate_s / step_s)


def placement_rows(placements: Any) -> list[dict[str, Any]]:
    """A plan's placements as JSON rows (a re-summary reads them back as rows)."""
    return [p if isinstance(p, dict) else dataclasses.asdict(p) for p in placements]


def trainer_gpus(placements: Any) -> int:
    """GPUs the trainer computes on (MFU is per GPU of the trainer, not of the run)."""
    rows = placement_rows(placements)
    return len({(r["node"], g) for r in rows if r["service"] == "trainer" for g in r["gpus"]}) or 1


def summarize(
    recipe: Any,
    run_plan: Any,
    records: list[dict[str, Any]],
    warmup: int,
    prompts: list[list[int]],
    peak: float | None,
) -> dict[str, Any]:
    """The benchmark's numbers from a run's metrics records (the first `warmup` left out)."""
    from recipes.lora import adapter_bytes
    from runtime.backends.build import model_spec

    if not records:
        return {"steps": 0}
    measured = records[warmup:] or records
    g = recipe.grpo
    completions = g.prompts_per_step * g.group_size
    replicas = len([p for p in placement_rows(run_plan.placements) if p["service"] == "generator"])
    # One generate call of one replica: steps_per_call steps' prompts over the replicas.
    call_sequences = -(-g.prompts_per_step * g.steps_per_call // max(1, replicas)) * g.group_size
    spec = model_spec(recipe)
    params = spec.num_params()
    prompt_len = mean([len(p) for p in prompts])
    response_len = mean([r["response/len_mean"] for r in measured])
    step_s = mean([r["time/step_s"] for r in measured])
    train_s = mean([r["time/train_s"] for r in measured])
    generate_s = mean([r["time/generate_s"] for r in measured if "time/generate_s" in r])
    engine_s = mean([r["time/engine_s"] for r in measured if "time/engine_s" in r])
    sync_s = mean([r["time/weight_sync_s"] for r in measured])
    lora = recipe.model.lora
    # what a version carries: every weight, or under LoRA the adapter alone
    width = 2 if recipe.model.dtype == "bfloat16" else 4
    weight_bytes = adapter_bytes(recipe.arch, lora, width) if lora else params * width
    train_tokens = completions * (prompt_len + response_len)
    used_gpus = run_plan.total_gpus or 1
    train_gpus = trainer_gpus(run_plan.placements)
    return {
        "recipe": recipe.name,
        "lora": lora.model_dump() if lora else None,
        "overrides": [
            *offline(None if recipe.model.init == "random" else recipe.model.hf_id),
            *NO_EVAL,
            f"grpo.max_response_tokens={g.max_response_tokens}",
        ],
        "gpus_used": used_gpus,
        "placements": placement_rows(run_plan.placements),
        "params": params,
        "completions_per_step": completions,
        "steps": len(records),
        "measured_steps": len(measured),
        "step_s": step_s,
        "samples_per_s_per_gpu": per(completions, step_s * used_gpus),
        # prompt + completion tokens of the step's samples per GPU-second (NeMo-RL's unit)
        "tokens_per_s_per_gpu": per(train_tokens, step_s * used_gpus),
        # versions between the policy that sampled a trained sequence and the one it trains
        "policy_staleness_mean": mean(
            [r["policy/staleness_mean"] for r in measured if "policy/staleness_mean" in r]
        ),
        "max_policy_age": g.max_policy_age,
        "steps_per_call": g.steps_per_call,
        "prompt_tokens_mean": prompt_len,
        "response_tokens_mean": response_len,
        "generate_s": generate_s,
        "sequences_per_generate_call": call_sequences,
        "generator_tp": recipe.layout.generator.tp,
        "generation_tokens_per_s": per(call_sequences * response_len, generate_s),
        # the same over the engine's own seconds in the call (what `vllm` alone times)
        "engine_s": engine_s,
        "engine_tokens_per_s": per(call_sequences * response_len, engine_s),
        # what the engine's thread spent in a call besides waiting (runtime.procs.usage): CPU
        # seconds, and how often it left its core waiting (voluntary) or was pushed off it
        # (involuntary); `vllm` alone records the same
        **engine_thread(measured, "generator/engine_thread_"),
        "generator_idle_share": idle_share(measured, generate_s, step_s),
        # publish + the slowest generator's load of the version (the path's latency, a
        # generation in flight not counted), and the publish alone: the trainer's stall
        "weight_sync_s": sync_s,
        # from the train step's end until every generator holds the version (runtime/control/
        # policy.py): with on-policy steps, how soon sampling uses the new policy
        "sync_ready_s": mean([r["sync/ready_s"] for r in measured if r.get("sync/ready_s")]),
        "publish_s": mean([r["time/publish_s"] for r in measured if "time/publish_s" in r]),
        # each mean over the steps that had it: a LoRA version's load into vLLM in parts, added
        # anew (vLLM's LoRAModel build, its activation into a slot) or written in place (the
        # plan, made once, and the write); a CUDA IPC receipt in parts, the manifest from the
        # store, the handle's opening, the load into the engine with the mapping's closing
        # (the open is inside the load); and the publish's part that put the version on its
        # paths (the rest of publish_s: its manifest into the store)
        **{
            f"{kind}_{part}_s": mean([r[k] for r in measured if k in r])
            for kind, parts in (
                ("adapter", ("build", "activate", "plan", "write")),
                ("receive", ("manifest", "open", "load")),
                ("publish", ("stage",)),
            )
            for part in parts
            for k in [f"time/{kind}_{part}_s"]
            if any(k in r for r in measured)
        },
        # Direct path (runtime.weights.direct): the trainer's broadcast, in the background.
        "push_s": mean([r["time/push_s"] for r in measured if "time/push_s" in r]),
        "push_gb_per_s": per(
            weight_bytes / 1e9, mean([r["time/push_s"] for r in measured if "time/push_s" in r])
        ),
        "weight_bytes": weight_bytes,
        "weight_sync_gb_per_s": per(weight_bytes / 1e9, sync_s),
        "train_s": train_s,
        "trainer_gpus": train_gpus,
        "trainer_tokens_per_s": per(train_tokens, train_s),
        # Model FLOPs (training_flops: attention included) per trainer GPU-second over peak.
        "mfu": per(
            sum(
                training_flops(
                    spec, completions, prompt_len + response_len, response_len, lora=bool(lora)
                ).values()
            ),
            train_s * peak * train_gpus,
        )
        if peak
        else None,  # fmt: skip
        "ratio_mean": mean([r["ratio/mean"] for r in measured if "ratio/mean" in r]),
        "clip_fraction": mean([r["clip_fraction"] for r in measured if "clip_fraction" in r]),
        "kl": mean([r["kl"] for r in measured]),
        "records": records,
    }


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    from recipes.settings import ALONE_GPU_SHARE
    from runtime.backends import build as services
    from runtime.backends.vllm_generator import VLLMGenerator

    recipe = load(args.recipe, 1, args.response_tokens)
    g = recipe.grpo
    spec = services.model_spec(recipe)
    tokenizer = services.load_tokenizer(recipe)
    prompts = prompt_tokens(recipe, count=64 * 4)
    # the CPUs, pinned (--cpus) before vLLM starts a thread
    placement = cpu_placement(args.cpus)
    gen = VLLMGenerator(
        spec,
        eos_token_id=services.eos_ids(tokenizer),
        pad_token_id=services.pad_id(tokenizer),
        max_model_len=g.max_prompt_tokens + g.max_response_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        # what a plan gives a generator with a GPU of its own
        gpu_memory_utilization=ALONE_GPU_SHARE,
        seed=g.seed,
        # --engine separate: the engine core in a process of its own (vLLM's default)
        engine_in_process=args.engine == "in-process",
    )
    loads: dict[str, Any] = {}
    if not args.calls_only:
        loads = load_weights(gen, spec)
    engine = engine_threads(args.engine == "in-process")

    process_cpus = os.sched_getaffinity(0)  # before a sweep pins this thread

    def timed(
        batch: list[list[int]], n: int, seed: int, pinned: int | None = None
    ) -> dict[str, Any]:
        """One generate call: its seconds and tokens, and what the engine's thread spent in it
        (CPU seconds and switches where it runs on this thread), the CPUs it was seen on, this
        process's seconds in garbage collection and (--speed-probe) a CPU's pace meanwhile,
        measured off the engine's CPU (`pinned`) where the sweep pinned it."""
        probe = None
        if args.speed_probe:
            probe = cpu_layout.SpeedProbe(cpus=(process_cpus - {pinned}) or process_cpus)
            time.sleep(0.2)  # its interpreter's start, not inside the call
        gc_clock = cpu_layout.GcClock()
        watch = cpu_layout.CpuWatch(engine)
        start, before = time.perf_counter(), thread_usage()
        out = gen.generate(batch, n, g.max_response_tokens, g.temperature, g.top_p, seed)
        call = {"s": time.perf_counter() - start, "tokens": sum(len(c.response_ids) for c in out)}
        seen = watch.stop()
        if before is not None:  # this thread's: the engine's only with the core in this process
            call.update(dataclasses.asdict(thread_usage().since(before)))
        call["cpus_seen"] = seen if len(seen) > 1 else next(iter(seen.values()), {})
        call["cpu_moves"] = sum(watch.moves.values())  # samples on another CPU than the last
        # the CPUs it was seen on meanwhile: busy, interrupt and stolen seconds (steal: the
        # hypervisor ran something else on the host CPU under the virtual one); all CPUs' steal
        on = {c for counts in watch.seen.values() for c in counts}
        call["cpu_seconds"] = {str(c): watch.seconds[c] for c in sorted(on) if c in watch.seconds}
        call["steal_s"] = watch.stolen_s()
        call["host_steal_s"] = sum(v["steal_s"] for v in watch.seconds.values())
        call.update(gc_clock.stop())
        if probe is not None:
            call.update(probe.stop())
        return call

    per_step = g.prompts_per_step

    def batch(i: int) -> list[list[int]]:
        i %= len(prompts) // per_step
        return prompts[i * per_step : (i + 1) * per_step]

    timed(batch(0), g.group_size, 0)  # warm-up
    sampler = GpuSampler(clock_window="calls")
    recorder = stack_recorder(args, "vllm")
    if recorder is not None:
        recorder.start(os.getpid())
    try:
        calls = [timed(batch(i), g.group_size, i + 1) for i in range(args.calls)]
    finally:
        sampler.stop()
        if recorder is not None:
            recorder.stop()
    # --cpu-sweep: the engine's thread pinned to one CPU a call, each CPU of the process's in
    # turn (the rest of the process where it was): each CPU's own speed, within one process
    sweep = []
    if args.cpu_sweep:
        target = engine[0][1] if args.engine == "separate" else 0  # 0: this thread
        held = os.sched_getaffinity(target)
        for k, cpu in enumerate(sorted(held)):
            os.sched_setaffinity(target, {cpu})
            sweep.append({"cpu": cpu, **timed(batch(k), g.group_size, 1000 + k, pinned=cpu)})
        os.sched_setaffinity(target, held)
    big = None if args.calls_only else timed(prompts[:64], 8, 99)  # 512 sequences
    gen.close()
    seconds = sum(c["s"] for c in calls)
    tokens = sum(c["tokens"] for c in calls)
    return {
        "recipe": recipe.name,
        "engine": args.engine,
        "weights": "vLLM's dummy load" if args.calls_only else "torchtitan init",
        "init_s": gen.init_seconds,
        "logprobs_mode": gen.logprobs_mode,
        "tensor_parallel_size": gen.tensor_parallel_size,
        "sequences_per_call": per_step * g.group_size,
        "max_new_tokens": g.max_response_tokens,
        "calls": args.calls,
        "call_s": seconds / args.calls,
        # each timed call: seconds, tokens, the engine thread's CPU seconds and switches, and
        # the CPUs it was seen on (samples every 50 ms; by "pid/tid" where several threads)
        "calls_list": calls,
        "generation_tokens_per_s": tokens / seconds,
        # the engine thread in the timed calls, and the GPUs' clocks meanwhile (as in `grpo`)
        **engine_thread(calls),
        "cpu_placement": placement,
        **({"cpu_sweep": sweep} if args.cpu_sweep else {}),
        "gpu_clocks": sampler.clocks(),
        "host_cpu": sampler.host_cpu(),
        **stacks(recorder),
        "tokens_per_s_512_sequences": big and big["tokens"] / big["s"],
        **loads,
    }


def load_weights(gen: Any, spec: Any) -> dict[str, Any]:
    """The GRPO run's initial weights (TorchTitan init, bf16; built on the CPU, the engine holds
    most of the GPU), loaded as the actor loads them: from CPU tensors; then from GPU tensors
    (into an engine of its own process both go through a file in /dev/shm)."""
    import torch

    from runtime.models import build_model, to_hf

    model = build_model(spec, "cpu")
    on_cpu = {k: v.to(torch.bfloat16) for k, v in to_hf(model.state_dict(), spec).items()}
    del model
    nbytes = sum(t.numel() * t.element_size() for t in on_cpu.values())
    gen.load_weights(on_cpu)
    load_cpu_s = gen.load_seconds
    on_gpu = {k: v.cuda() for k, v in on_cpu.items()}
    gen.load_weights(on_gpu)
    load_gpu_s = gen.load_seconds
    return {
        "weight_bytes": nbytes,
        "load_weights_from_cpu_s": load_cpu_s,
        "load_weights_from_cpu_gb_per_s": per(nbytes and nbytes / 1e9, load_cpu_s),
        "load_weights_from_gpu_s": load_gpu_s,
        "load_weights_from_gpu_gb_per_s": per(nbytes and nbytes / 1e9, load_gpu_s),
    }


def parse_config(text: str) -> dict[str, int]:
    """`ac=0,compile=1,mb=8192` -> {"ac": 0, "compile": 1, "mb": 8192, "head": 1} (unset keys:
    defaults; `head=0` keeps the output projection's log-softmax eager under `compile=1`)."""
    config = {"ac": 1, "compile": 0, "mb": 8192, "head": 1}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in config or not value.isdigit():
            raise SystemExit(f"--config {text!r}: expected ac=0|1,compile=0|1,mb=TOKENS,head=0|1")
        config[key] = int(value)
    return config


def attention_flops_per_token(spec: Any, seq_len: float) -> float:
    """Forward + backward FLOPs of causal attention scores and values per token (3 x forward;
    a causal mask halves the 4 * seq * heads * head_dim of full attention)."""
    return 3 * 2 * spec.n_layers * seq_len * spec.n_heads * spec.head_dim


def training_flops(
    spec: Any, sequences: float, seq_len: float, response_len: float, lora: bool = False
) -> dict[str, float]:
    """Model FLOPs (forward + backward) of one training pass, as the trainer computes them.

    - `dense`: 6 x the weights' multiply-adds (LoRA: 4 x, the frozen base has no weight
      gradients; the adapter's own, under 1 % at rank 16, are not counted). The body (every weight but the embedding and
      the output projection) runs on every token; the output projection only on response
      positions (`response_logprobs`); the embedding lookup costs no FLOPs.
    - `attention`: causal attention, 6 * layers * seq * heads * head_dim per token.
    Recomputed activations are not counted (MFU, not hardware FLOPs).
    """
    head = spec.vocab_size * spec.dim
    body = spec.num_params() - head * (1 if spec.tie_embeddings else 2)
    tokens = sequences * seq_len
    dense = (4 if lora else 6) * (body * tokens + head * sequences * response_len)
    return {"dense": dense, "attention": attention_flops_per_token(spec, seq_len) * tokens}


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch

    from runtime.backends import OptimizerConfig
    from runtime.backends import build as services
    from runtime.backends.fsdp_trainer import FSDPTrainer
    from runtime.grpo import policy_loss

    recipe = load(args.recipe, 1, None)
    g = recipe.grpo
    spec = services.model_spec(recipe)
    params = spec.num_params()
    cuda = args.device == "cuda"
    peak = gpu_info()["peak_bf16_flops"] if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n, width = args.sequences, args.seq_len
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (n, width), generator=gen)
    mask = torch.zeros(n, width, dtype=torch.bool)
    mask[:, width - int(width * args.response_share) :] = True
    advantages = torch.randn(n, generator=gen)
    old = torch.where(mask, -torch.rand(n, width, generator=gen) * 5, torch.zeros(n, width))
    ref = old + torch.where(mask, torch.randn(n, width, generator=gen) * 0.01, 0.0)
    rows = []
    for text in args.config or ["ac=1,compile=0,mb=8192", "ac=0,compile=1,mb=8192"]:
        config = parse_config(text)
        print(f"trainer {recipe.name}: {n} x {width} tokens, {config}", flush=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer = FSDPTrainer(
            spec,
            OptimizerConfig.from_grpo(g),
            temperature=g.temperature,
            device=args.device,
            tokens_per_micro_batch=config["mb"],
            activation_checkpointing=bool(config["ac"]),
            compile=bool(config["compile"]),
            compile_head=bool(config["head"]),
        )

        def step(trainer: Any = trainer) -> None:
            trainer.train_step(
                tokens, mask, advantages, old, ref, policy_loss, variant=g.loss,
                clip_low=g.clip_low, clip_high=g.clip_high, kl_beta=g.kl_beta,
                max_response_tokens=width,
            )  # fmt: skip

        times = []
        for i in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        profile = profile_step(step, sync, cuda) if args.profile else None
        step_s = statistics.fmean(times)
        total = n * width
        rows.append({
            "config": text, **config, "step_s": step_s, "tokens": total,
            "tokens_per_s": total / step_s,
            **trainer_mfu(spec, n, width, args.response_share, step_s, peak),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            **({"profile": profile} if profile else {}),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {"recipe": recipe.name, "params": params, "sequences": n, "seq_len": width,
            "response_share": args.response_share, "warmup": args.warmup, "steps": args.steps,
            "configs": rows}  # fmt: skip


def profile_step(step: Any, sync: Any, cuda: bool) -> dict[str, Any]:
    """One more step under torch.profiler (runtime.backends.profiling, what a run's
    `trainer.profile_step` writes): GPU time per kind of kernel, the busiest kernels, and the
    share of the step's wall time no kernel ran; on a CPU each op's own CPU time instead."""
    from runtime.backends.profiling import profiled

    return profiled(step, "cuda" if cuda else "cpu")[1]


def ours(section: Any) -> bool:
    """A section one of our runs wrote (a recipe and its step records), not a peer's: a verl run
    in the same file has records and steps too, but no recipe."""
    return isinstance(section, dict) and "records" in section and "recipe" in section


def compare(result: dict[str, Any]) -> None:
    """Each GRPO section's ratios to the standalone vLLM and TRL sections of the same file."""
    alone = result.get("standalone_vllm") or {}
    trl = result.get("trl") or {}
    for section in result.values():
        if not ours(section):
            continue
        # Like for like: the same recipe, TP width and sequences per call (vLLM's throughput
        # grows with the batch: 256 sequences a call are not compared with 128 alone).
        same_batch = section.get("sequences_per_generate_call") == alone.get(
            "sequences_per_call"
        ) and section.get("generator_tp", 1) == alone.get("tensor_parallel_size", 1)
        if alone.get("recipe") == section.get("recipe"):
            section["generation_to_standalone"] = per(
                section.get("generation_tokens_per_s"), alone.get("generation_tokens_per_s")
            ) if same_batch else None  # fmt: skip
            section["standalone_engine"] = alone.get("engine")
        if trl and section.get("recipe") == "qwen3-1.7b":
            section["samples_per_s_to_trl"] = per(
                section.get("samples_per_s_per_gpu"), trl.get("samples_per_s_per_gpu")
            )
    # The "grpo" section's own ratio, at the top of the file for a quick look.
    result["generation_in_loop_to_standalone"] = (result.get("grpo") or {}).get(
        "generation_to_standalone"
    )


def trainer_mfu(
    spec: Any, sequences: int, seq_len: int, response_share: float, step_s: float, peak: float
) -> dict[str, float | None]:
    """MFU of one `train` config, with and without attention's FLOPs."""
    flops = training_flops(spec, sequences, seq_len, int(seq_len * response_share))
    return {
        "mfu": per(flops["dense"] + flops["attention"], step_s * peak) if peak else None,
        "mfu_without_attention": per(flops["dense"], step_s * peak) if peak else None,
    }


def resummarize(result: dict[str, Any]) -> None:
    """Derive every section's numbers again from what was measured (no GPU needed): a GRPO
    section's from its records, a `train` section's MFU from its step times."""
    from types import SimpleNamespace

    from runtime.backends.build import model_spec

    peak = (result.get("device") or {}).get("peak_bf16_flops")
    for section in result.values():
        if isinstance(section, dict) and "configs" in section and "seq_len" in section:
            spec = model_spec(load(section["recipe"], 1, None))
            for row in section["configs"]:
                row.pop("mfu_with_attention", None)  # older files: now "mfu"
                row.update(trainer_mfu(spec, section["sequences"], section["seq_len"],
                                       section["response_share"], row["step_s"], peak))  # fmt: skip
            continue
        if not isinstance(section, dict) or not section.get("records"):
            continue
        response = next(o for o in section["overrides"] if o.startswith("grpo.max_response"))
        recipe = load(
            section["recipe"],
            len(section["records"]),
            int(response.split("=", 1)[1]),
            section.get("set_by_hand") or section.get("overrides_extra") or [],
            model_folder=(section.get("model_folder") or {}).get("path"),
        )
        plan = SimpleNamespace(placements=section["placements"], total_gpus=section["gpus_used"])
        warmup = section["steps"] - section["measured_steps"]
        section.update(
            summarize(recipe, plan, section["records"], warmup, prompt_tokens(recipe), peak)
        )


def table(result: dict[str, Any]) -> str:
    """The file's GRPO sections and TRL baselines as a Markdown table: every row with its
    samples and tokens (prompt + completion) per GPU-second and its policy staleness."""

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    head = ("| run | recipe | GPUs | step s | samples/s/GPU | tokens/s/GPU | staleness | vs TRL "
            "| gen tok/s | vs vLLM alone | trainer stall s | publish + load s (GB/s) "
            "| trainer MFU | generator idle |")  # fmt: skip
    rows = [head, "|" + "---|" * 14]
    for name, s in result.items():
        if not ours(s) or not s.get("steps"):
            continue
        sync = f"{num(s.get('weight_sync_s'), '.3f')} ({num(s.get('weight_sync_gb_per_s'), '.0f')})"
        rows.append(
            f"| {name} | {s['recipe']} | {s['gpus_used']} | {num(s['step_s'], '.2f')} "
            f"| {num(s['samples_per_s_per_gpu'], '.1f')} "
            f"| {num(s.get('tokens_per_s_per_gpu'), '.0f')} "
            f"| {num(s.get('policy_staleness_mean'), '.2f')} "
            f"| {num(s.get('samples_per_s_to_trl'), '.2f')} "
            f"| {num(s['generation_tokens_per_s'], '.0f')} "
            f"| {num(s.get('generation_to_standalone'), '.2f')} "
            f"| {num(s.get('publish_s'), '.3f')} | {sync} | {num(s['mfu'], '.2f')} "
            f"| {num(s['generator_idle_share'], '.0%')} |"
        )
    for name, trl in result.items():
        if not (name.startswith("trl") and isinstance(trl, dict) and trl.get("step_s")):
            continue
        rows.append(
            f"| {name} | qwen3-1.7b, TRL {trl.get('versions', {}).get('trl', '')} GRPOTrainer "
            f"(vLLM colocate) | "
            f"{trl.get('processes', 1)} | {num(trl.get('step_s'), '.2f')} "
            f"| {num(trl.get('samples_per_s_per_gpu'), '.1f')} "
            f"| {num(trl.get('tokens_per_s_per_gpu'), '.0f')} "
            f"| {num(trl.get('policy_staleness_mean'), '.2f')} | 1 | - | - | - "
            f"| {num(trl.get('weight_sync_s'), '.3f')} | - | - |"
        )
    for name, peer in result.items():
        if not (isinstance(peer, dict) and peer.get("system") == "verl" and peer.get("step_s")):
            continue
        rows.append(
            f"| {name} | qwen3-{peer.get('model_size', '')}, verl {peer.get('entry', '')} | "
            f"{peer.get('gpus', 1)} | {num(peer.get('step_s'), '.2f')} "
            f"| {num(peer.get('samples_per_s_per_gpu'), '.1f')} "
            f"| {num(peer.get('tokens_per_s_per_gpu'), '.0f')} "
            f"| {num(peer.get('policy_staleness_mean'), '.2f')} | - | - | - | - "
            f"| {num(peer.get('weight_sync_s'), '.3f')} | - | - |"
        )
    for cfg in (result.get("trainer_mfu") or {}).get("configs", []):
        t = result["trainer_mfu"]
        rows.append(
            f"| trainer alone, {t['sequences']} x {t['seq_len']} tokens, {cfg['config']} "
            f"| {t['recipe']} | 1 | {num(cfg['step_s'], '.2f')} | - | - | - | - | - | - | - | - "
            f"| {num(cfg['mfu'], '.2f')} | - |"
        )
    alone = result.get("standalone_vllm")
    if alone:
        rows.append(
            f"| standalone_vllm | {alone['recipe']} | 1 | - | - | - | - | - "
            f"| {num(alone['generation_tokens_per_s'], '.0f')} | 1 | - | - | - | - |"
        )
    return "\n".join(rows)


def merge(out: Path, parts: list[Path]) -> dict[str, Any]:
    """Sections of several result files of one machine (runs side by side) into `out`."""
    result = json.loads(out.read_text()) if out.exists() else {}
    for path in parts:
        part = json.loads(path.read_text())
        device = result.setdefault("device", part.get("device"))
        if part.get("device") and part["device"]["name"] != device["name"]:
            raise SystemExit(f"{path}: ran on {part['device']['name']}, not {device['name']}")
        result.setdefault("versions", part.get("versions"))
        result.setdefault("date", part.get("date"))
        for key, value in part.items():
            if isinstance(value, dict) and key not in ("device", "versions"):
                result[key] = value
    return result


def cpu_spec(text: str) -> str:
    """--cpus: a word of cpus.resolve or a CPU list, checked before anything starts."""
    if text.strip() not in cpu_layout.SPEC_WORDS:
        try:
            if not cpu_layout.parse_cpu_list(text):
                raise ValueError(f"not a CPU list: {text!r}")
        except ValueError as e:
            words = ", ".join(cpu_layout.SPEC_WORDS)
            raise argparse.ArgumentTypeError(f"{e}; or one of {words}") from None
    return text.strip()


# mode -> what runs it, and the JSON key its section goes under by default
MODES = {
    "grpo": (run_grpo, "grpo"),
    "vllm": (run_vllm, "standalone_vllm"),
    "train": (run_train, "trainer_mfu"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=[*MODES, "merge", "write-model"])
    p.add_argument("parts", nargs="*", type=Path, help="merge: result files to merge into --out")
    p.add_argument("--recipe", default="qwen3-1.7b")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the averages")
    p.add_argument("--response-tokens", type=int, default=512, help="0: the recipe's")
    p.add_argument(
        "--prompt-tokens", type=int, default=None, metavar="N",
        help="grpo: prompts of about N tokens on average (a filler before the arith problems, "
        "within grpo.max_prompt_tokens); default: the arith prompts as they are (~207 templated)",
    )  # fmt: skip
    p.add_argument("--gpus", type=int, default=None, help="default: all visible")
    p.add_argument("--calls", type=int, default=3, help="vllm: timed generation calls")
    p.add_argument(
        "--cpus", type=cpu_spec, default=None, metavar="SPEC",
        help="vllm: pin the process to CPUs before the engine starts: node (the GPU's NUMA "
        "node), cores (one CPU a physical core, no SMT siblings), node-cores, or a list (0-3,8)",
    )  # fmt: skip
    p.add_argument(
        "--cpu-sweep", action="store_true",
        help="vllm: after the timed calls, one call with the engine's thread pinned to each "
        "CPU of the process in turn (cpu_sweep in the JSON)",
    )  # fmt: skip
    p.add_argument(
        "--speed-probe", action="store_true",
        help="vllm: each call beside a process that hashes a fixed buffer every 50 ms on "
        "another CPU (probe_mb_per_s in calls_list): the host's CPU pace during the call",
    )  # fmt: skip
    p.add_argument(
        "--calls-only", action="store_true",
        help="vllm: only the timed calls (vLLM's dummy weights; no weight loads, no "
        "512-sequence point): a shorter process",
    )  # fmt: skip
    p.add_argument(
        "--engine",
        choices=["in-process", "separate"],
        default="in-process",
        help="vllm: the engine core in this process (the generator's default) or in a process "
        "of its own (vLLM's default; the generator's with --set generator.engine=separate)",
    )
    p.add_argument("--sequences", type=int, default=64, help="train: sequences per step")
    p.add_argument("--seq-len", type=int, default=2048, help="train: tokens per sequence")
    p.add_argument("--response-share", type=float, default=0.75, help="train: response part")
    p.add_argument("--config", action="append", default=None, help="train: ac=,compile=,mb=,head=")
    p.add_argument(
        "--profile", action="store_true", help="train: one more step under torch.profiler"
    )
    p.add_argument("--device", default="cuda", help="train: cuda, or cpu (a check of the code)")
    p.add_argument(
        "--py-spy", default=None, metavar="DIR",
        help="grpo, vllm: record every process's stacks with py-spy (bench/stacks.py) over the "
        "measured steps or the timed calls; the raw file goes to DIR, its summary to the JSON",
    )  # fmt: skip
    p.add_argument(
        "--py-spy-from", type=int, default=None, metavar="N",
        help="grpo: start recording once N steps have ended (default: --warmup)",
    )  # fmt: skip
    p.add_argument("--tag", default="", help="a suffix for the files --py-spy writes")
    p.add_argument("--run-dir", default=None)
    p.add_argument(
        "--model-folder", default=None, metavar="DIR",
        help="grpo: the weights from a Hugging Face folder of random weights in DIR (written "
        "once, kept while it holds the recipe's architecture; e.g. /dev/shm/qwen3-8b-hf), read "
        "as a user's model is (model.hf_id=DIR), instead of TorchTitan's seeded init",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], help="recipe override key=value (repeatable)"
    )
    p.add_argument(
        "--section", default=None, help="JSON key (default: grpo / standalone_vllm / trainer_mfu)"
    )
    p.add_argument("--out", default=str(ROOT / "bench/results/gpu_grpo.json"))
    args = p.parse_intermixed_args()

    if args.mode == "write-model":  # model_folder()'s child
        from product_path import random_model_once

        from recipes import load_recipe

        if not args.model_folder:
            p.error("write-model needs --model-folder")
        info = random_model_once(load_recipe(args.recipe), Path(args.model_folder), args.device)
        print(json.dumps(info), flush=True)
        return 0
    out = Path(args.out)
    if args.mode == "merge":
        result = merge(out, args.parts)
        resummarize(result)
        compare(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(table(result))
        return 0
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update(device=gpu_info(), versions=versions(), date=time.strftime("%Y-%m-%d"))
    run_mode, default = MODES[args.mode]
    section = run_mode(args)
    result[args.section or default] = section
    compare(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in section.items() if k not in ("records", "placements")}
    print(json.dumps(summary, indent=2))
    print(table(result))
    return int(section.get("exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
