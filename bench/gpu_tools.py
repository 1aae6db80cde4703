"""Multi-turn tool-use throughput through the product path: `python -m runtime` on the
`qwen3-1.7b-tools` recipe's plan, random weights, a tool that takes 100 ms a call; samples/s per
GPU, time in tools per step and the generator's idle share read from the run's metrics.jsonl.

    python bench/gpu_tools.py [--recipe qwen3-1.7b-tools] [--gpus 1] [--steps 12] [--warmup 5]
        [--tool-s 0.1] [--max-turns N] [--turn-tokens N] [--response-tokens N] [--out FILE]
        [--set KEY=VALUE ...]
    python bench/gpu_tools.py --dry-cpu      # the CPU check: tiny-tools, the same code path

On the GPU machine: `bash scripts/gpu/device_run.sh tools` (scripts/gpu/README.md).

Random weights cannot solve GSM8K, and no Hub is reachable there, so the run gets, by `--set`
only (the JSON lists them):

- `env.name=bench.tools_env:WaitEnvironment`: an OpenEnv environment hosted like any user's,
  whose one tool, `wait`, sleeps `--tool-s` and whose reward is synthetic (bench/tools_env.py);
- `model.init=random` and `model.tokenizer=<work>/tokenizer`: a character tokenizer sized to the
  model's vocabulary, with Qwen3's chat layout and tool-call format (the tiny-tools template), in
  which a run of ids outside its characters reads as one call of `wait`. A random policy samples
  almost nothing else, so nearly every turn runs to `--turn-tokens`, is parsed as a call in
  Qwen3's format, steps the environment and gets the tool's result: `--max-turns` turns an
  episode, each but the last followed by a 100 ms call (as the single-turn bench's tokenizer
  reads those ids as nothing);
- `dataset.path=builtin:arith`: prompts of about 200 characters, no download; no held-out
  evaluation; `--steps`; no checkpoint but the last.

Figures over the steps after the first `--warmup`: samples/s per GPU (episodes a step / step
seconds / GPUs), time in tools per step (the calls' seconds summed over the step's episodes, and
the same per episode), the generator's idle share (1 - generating seconds / wall seconds, all
measured steps together), turns and tool calls an episode, tool errors and dropped episodes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from child import run_child  # noqa: E402

DRY_RECIPE = "tiny-tools"
# how long a stopped run may take to shut its procs down before its session is killed
STOP_GRACE_S = 40
TOOL = "wait"
CALL = f'<tool_call>\n{{"name": "{TOOL}", "arguments": {{}}}}\n</tool_call>'
PAD, START, END, UNK = "<pad>", "<|im_start|>", "<|im_end|>", "<unk>"
# whole tokens, as Qwen3's BPE has them (and the tiny-tools template writes)
MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "system",
    "user",
    "assistant",
    TOOL,
)


def fail(message: str) -> None:
    """A mistake in the arguments: one line, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def bench_tokenizer(vocab_size: int, characters: str) -> Any:
    """<pad>, <|im_start|>, <|im_end|> (EOS), <unk>, `characters`, filler ids up to
    `vocab_size` and MARKERS, with the tiny-tools chat template (Qwen3's layout). Decoding reads
    each run of filler ids as one CALL."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from runtime.tasks.tiny_tools.tokenization import CHAT_TEMPLATE

    symbols = [PAD, START, END, UNK, *characters]
    spare = vocab_size - len(symbols) - len(MARKERS)
    if spare < 1:
        raise ValueError(f"a vocabulary of {vocab_size} leaves no id for the calls")
    vocab = {s: i for i, s in enumerate([*symbols, *(f"<unused_{i}>" for i in range(spare))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Sequence(
        [decoders.Fuse(), decoders.Replace(Regex(r"(<unused_\d+>)+"), CALL)]
    )
    core.add_special_tokens([AddedToken(t, special=True) for t in (PAD, START, END, UNK)])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=START,
        eos_token=END,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
    )


def write_tokenizer(recipe: Any, folder: Path) -> dict[str, Any]:
    """The bench tokenizer for `recipe`'s vocabulary, saved in `folder`: printable characters
    for a full-size model, digits and a newline for the tiny one (others read as <unk>)."""
    from runtime.tasks.arith.tokenization import CHARACTERS

    vocab = recipe.arch.vocab_size
    characters = CHARACTERS if vocab > 4 * len(CHARACTERS) else "0123456789\n"
    tok = bench_tokenizer(vocab, characters)
    if len(tok) != vocab:
        raise AssertionError(f"bench tokenizer of {len(tok)} ids for a vocabulary of {vocab}")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    calls = vocab - 4 - len(characters) - len(MARKERS)
    return {"vocab_size": vocab, "characters": len(characters), "call_ids": calls}


def by_hand(a: argparse.Namespace, tokenizer: Path) -> list[str]:
    """The `--set`s the run gets beyond the recipe (the module docstring says why)."""
    sets = [
        "model.init=random",
        f"model.tokenizer={tokenizer}",
        "eval.enabled=false",
        "env.name=bench.tools_env:WaitEnvironment",
        f"env.args={{tool_s: {a.tool_s}}}",
        f"env.max_turns={a.max_turns}",
        f"env.max_turn_tokens={a.turn_tokens}",
    ]
    if not a.dry_cpu:
        sets += ["dataset.path=builtin:arith", f"grpo.max_response_tokens={a.response_tokens}"]
    return sets


def command(a: argparse.Namespace, sets: list[str], run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "runtime", "--recipe", a.recipe, "--gpus", str(a.gpus)]
    cmd += ["--run-dir", str(run_dir), "--steps", str(a.steps), "--checkpoint-every", "0"]
    for s in [*sets, *a.sets]:
        cmd += ["--set", s]
    return cmd


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.fmean(values) if values else None


def idle_share(timed: list[dict[str, Any]], replicas: int = 1) -> float | None:
    """1 - the generator's sampling seconds over the steps' wall seconds (times its replicas):
    the episodes count the seconds in which a replica had a turn of theirs in flight
    (`episode/sampling_s`, a replica's overlapping episode calls counted once). None where a
    record lacks it."""
    wall = sum(r["time/step_s"] for r in timed) * max(replicas, 1)
    if (
        not timed
        or wall <= 0
        or not all(isinstance(r.get("episode/sampling_s"), int | float) for r in timed)
    ):
        return None
    return 1 - sum(r["episode/sampling_s"] for r in timed) / wall


def _share(timed: list[dict[str, Any]], key: str) -> float | None:
    """`key`'s seconds over the episode calls' seconds (`key` / its `..._share`), all steps
    together."""
    share = key.removesuffix("_s") + "_share"
    pairs = [(r[key], r[share]) for r in timed if r.get(share)]
    calls = sum(idle / part for idle, part in pairs)
    return sum(idle for idle, _ in pairs) / calls if calls else None


def summarize(
    rows: list[dict[str, Any]],
    warmup: int,
    gpus: int,
    episodes_per_step: int,
    replicas: int = 1,
) -> dict[str, Any]:
    """Figures over the step records after the first `warmup` (`replicas`: the plan's
    generator replicas)."""
    steps = [r for r in rows if "time/step_s" in r]
    timed = [r for r in steps if r["step"] > warmup]
    wall = sum(r["time/step_s"] for r in timed)
    step_s = wall / len(timed) if timed else None
    idle = idle_share(timed, replicas)
    tool_s = _mean(timed, "episode/tool_s")
    calls = _mean(timed, "episode/tool_calls")
    return {
        "steps": len(steps),
        "warmup_steps": len(steps) - len(timed),
        "measured_steps": len(timed),
        "episodes_per_step": episodes_per_step,
        "step_times_s": [round(r["time/step_s"], 3) for r in steps],
        "step_s": step_s,
        "samples_per_s_per_gpu": episodes_per_step / step_s / max(gpus, 1) if step_s else None,
        # the calls' seconds summed over a step's episodes (they run concurrently), and per
        # episode: what the tools cost, not the wall time they held a step up
        "tool_s_per_step": tool_s,
        "tool_s_per_episode": tool_s / episodes_per_step if tool_s is not None else None,
        "tool_calls_per_step": calls,
        "tool_calls_per_episode": calls / episodes_per_step if calls is not None else None,
        "tool_s_per_call": tool_s / calls if tool_s is not None and calls else None,
        # the share of the measured steps' wall time the generator sampled nothing, and of its
        # episode calls' time spent waiting on the environments (tools, opening, scoring)
        "generator_idle_share": idle,
        "generator_idle_share_in_calls": _share(timed, "episode/generator_idle_s"),
        "env_wait_s_per_step": _mean(timed, "episode/env_wait_s"),
        # of it, opening the episodes and closing them (the rest: the tool rounds)
        "open_s_per_step": _mean(timed, "episode/open_s"),
        "close_s_per_step": _mean(timed, "episode/close_s"),
        "generator_idle_s_per_step": _mean(timed, "episode/generator_idle_s"),
        "turns_mean": _mean(timed, "episode/turns_mean"),
        "tool_errors_per_step": _mean(timed, "episode/tool_errors"),
        "malformed_calls_per_step": _mean(timed, "episode/malformed_calls"),
        "dropped_episodes_per_step": _mean(timed, "episode/dropped"),
        "response_tokens_mean": _mean(timed, "response/len_mean"),
        "generate_s": _mean(timed, "time/generate_s"),
        # a turn's seconds as the rollout loop waited for them, and the engine's own in them
        # (the rest: the call's way to the generator and back)
        "turn_s": _mean(timed, "episode/turn_s"),
        "turn_engine_s": _mean(timed, "episode/turn_engine_s"),
        "train_s": _mean(timed, "time/train_s"),
        "reward_mean": _mean(timed, "reward/mean"),
        # every episode/, generator/, time/ and gpu/ (turns on a shared GPU) figure the
        # records hold, means over the measured steps
        "means": {
            k: _mean(timed, k)
            for k in sorted({k for r in timed for k in r})
            if k.startswith(("episode/", "generator/", "time/", "gpu/"))
        },
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    from gpu_grpo import gpu_info, placement_rows, run_profiles, versions

    from recipes import apply_overrides, load_recipe, plan
    from runtime.control.metrics import read_metrics
    from runtime.procs.host import gpu_type

    work = Path(a.work)
    recipe = load_recipe(a.recipe)
    tokenizer = work / "tokenizer"
    made = write_tokenizer(recipe, tokenizer)
    sets = by_hand(a, tokenizer)
    try:
        ran = apply_overrides(recipe, [*sets, *a.sets])
    except Exception as e:  # noqa: BLE001 - the recipe's own one line
        fail(str(e))
    accel = None if a.dry_cpu else gpu_type()  # as `python -m runtime` picks it
    run_plan = plan(ran, a.gpus, accelerator=accel)
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = command(a, sets, run_dir)
    log = Path(a.log) if a.log else None
    print("running:", " ".join(cmd), flush=True)
    started = time.perf_counter()
    code = run_child(cmd, log, ROOT, STOP_GRACE_S)
    wall_s = time.perf_counter() - started
    if log:
        print("\n".join(log.read_text().splitlines()[-15:]), flush=True)
    rows = read_metrics(run_dir / "metrics.jsonl")
    g = ran.grpo
    used = run_plan.total_gpus or 0
    replicas = sum(p.service == "generator" for p in run_plan.placements)
    summary = summarize(rows, a.warmup, used, g.prompts_per_step * g.group_size, replicas)
    profiles = run_profiles(run_dir)  # trainer.profile_step's summaries, where one was set
    if not a.keep_run:
        shutil.rmtree(run_dir, ignore_errors=True)
    complete = code == 0 and summary["measured_steps"] > 0
    return {
        "system": "forgesky",
        "mode": "dry_cpu" if a.dry_cpu else "gpu",
        "recipe": a.recipe,
        "gpus": used,
        "command": cmd,
        "set_by_hand": [*sets, *a.sets, f"--steps {a.steps}", "--checkpoint-every 0"],
        "plan": {
            "accelerator": run_plan.accelerator,
            "share": run_plan.share,
            "placements": placement_rows(run_plan.placements),
        },
        "tool_s": a.tool_s,
        "max_turns": a.max_turns,
        "turn_tokens": a.turn_tokens,
        # episode calls a generator replica ran at once (env.batches_in_flight)
        "batches_in_flight": ran.env.batches_in_flight,
        "max_policy_age": g.max_policy_age,
        "max_response_tokens": g.max_response_tokens,
        "tokenizer": made,
        "wall_s": round(wall_s, 1),
        "exit_code": 0 if complete else (code or 1),
        "log": str(log) if log else "the bench's own output",
        "device": gpu_info(),
        "versions": versions(),
        **summary,
        **({"profiles": profiles} if profiles else {}),
        "records": rows,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="qwen3-1.7b-tools")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="first steps left out of the figures: the compiles, and two steps off the filling "
        "of its pipeline",
    )
    p.add_argument("--tool-s", type=float, default=0.1, help="seconds a tool call takes")
    # the episodes' caps: by default the recipe's own (env.max_turns, env.max_turn_tokens,
    # grpo.max_response_tokens), which a random policy fills: the longest episodes the recipe
    # allows, what its planner prices (runs before 2026-11-30d took 96 tokens a turn and 512
    # an episode; their JSON says so)
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--turn-tokens", type=int, default=None, help="tokens a turn may sample")
    p.add_argument(
        "--response-tokens", type=int, default=None, help="an episode's tokens after its prompt"
    )
    p.add_argument("--out", default=None, help="JSON to merge the section into")
    p.add_argument("--section", default=None, help="default: tools_<GPUS>gpu")
    p.add_argument("--work", default=None, help="tokenizer and run dir (default: a temp folder)")
    p.add_argument("--log", default=None, help="the runtime's output (default: this one's)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--keep-run", action="store_true", help="keep the run's folder")
    p.add_argument("--dry-cpu", action="store_true", help="tiny-tools on the CPU: the code path")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.dry_cpu:
        a.recipe, a.gpus = DRY_RECIPE, 0
        a.turn_tokens = min(a.turn_tokens or 4, 4)
        a.max_turns = min(a.max_turns or 3, 3)
        a.out = a.out or str(Path(tempfile.gettempdir()) / "gpu_tools_dry_cpu.json")
    else:
        from recipes import load_recipe

        caps = load_recipe(a.recipe)
        a.max_turns = a.max_turns or caps.env.max_turns
        a.turn_tokens = a.turn_tokens or caps.env.max_turn_tokens
        a.response_tokens = a.response_tokens or caps.grpo.max_response_tokens
    if a.steps <= a.warmup:
        fail(f"--steps {a.steps} leaves no step after --warmup {a.warmup}")
    if a.warmup < 0 or a.gpus < 0 or a.tool_s < 0:
        fail("--warmup, --gpus and --tool-s are 0 or more")
    if a.max_turns < 1 or a.turn_tokens < 1:
        fail("--max-turns and --turn-tokens are 1 or more")
    a.work = a.work or str(Path(tempfile.gettempdir()) / "gpu-tools-bench")
    a.section = a.section or ("dry_cpu" if a.dry_cpu else f"tools_{a.gpus}gpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(a)
    if a.out:
        from gpu_sft import merge

        merge(Path(a.out), result, a.section)
        print(f"-> {a.out}#{a.section}")
    print(
        f"forgesky {a.recipe} on {result['gpus']} GPU(s), tools of {a.tool_s:g} s: "
        f"{result['samples_per_s_per_gpu']} samples/s per GPU, step {result['step_s']} s, "
        f"tools {result['tool_s_per_step']} s a step, generator idle "
        f"{result['generator_idle_share']}, {result['turns_mean']} turns and "
        f"{result['tool_calls_per_episode']} calls an episode over {result['measured_steps']} "
        f"steps, exit {result['exit_code']}",
        flush=True,
    )
    return int(result["exit_code"])


if __name__ == "__main__":
    raise SystemExit(main())
