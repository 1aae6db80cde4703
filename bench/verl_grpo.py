"""verl's GRPO on a random-weight Qwen3: the third peer beside gpu_grpo.py and trl_grpo.py.

    python bench/verl_grpo.py [--gpus 1] [--policy on|off|colocate-async] [--steps 6] [--warmup 2]
        [--out FILE] [--section verl]               # on the GPU machine, in verl's environment
    python bench/verl_grpo.py --check-config [...]  # no GPU: verl composes and validates the
                                                    # run's configuration, loads its data and reward

On the GPU machine: `bash scripts/gpu/device_run.sh verl` or `PAIRS_PEER=verl ... pairs on|off
N` (scripts/gpu/README.md); verl 0.9.1 runs in an environment of its own layered over the
stack's (transformers 5.9.0, which verl needs, over the image's 5.17.0; the stack's vLLM 0.24.0
and torch 2.11.0 underneath). The bench writes, in a work folder (/dev/shm/verl-bench, else the
temporary folder), the model folder bench/trl_grpo.py writes (Qwen3 of recipes/architectures.py's
numbers, random bf16 weights, the arith character tokenizer padded to the 151,936-id vocabulary)
with a chat template that adds <bos> and nothing else, and a parquet of builtin:arith questions
cut or space-padded to 206 characters, each one user message (verl's `prompt` column: chat
messages), so every prompt is 207 tokens, the mean of the grpo run's templated prompts; then it
runs `python -m verl.trainer.main_ppo` (on) or `python -m
verl.experimental.one_step_off_policy.main_ppo` (off) as a subprocess with Hydra overrides and
reads the step records verl's file logger writes (one JSON line a step:
`{"step": N, "data": {"timing_s/step": ..., ...}}`), the console's `step:N - key:value - ...`
lines where the file is missing.

The run, as ours (bench/gpu_grpo.py grpo on the qwen3-1.7b plan) and TRL's side:
- 16 prompts x 8 completions a step (`data.train_batch_size=16`, `rollout.n=8`), one optimizer
  step a step (`ppo_mini_batch_size=16` prompts, one epoch); completions of 512 tokens never
  stopped early (`rollout.ignore_eos=True`); temperature 1, no top-p or top-k;
- GRPO advantages (group mean and standard deviation), the clipped surrogate with clip 0.2 /
  0.28, each sequence's token mean averaged over sequences (`seq-mean-token-mean`, our "grpo"
  aggregation), KL to a reference model in the loss with beta 0.1 (`use_kl_loss`,
  `kl_loss_type=low_var_kl`: k3, ours' estimator, clamped to [-10, 10] by verl), lr 1e-5,
  AdamW without weight decay (ours'; verl's default is 0.01), gradient clipping at 1.0, fp32
  master weights, bf16 compute; the rollout's log-probs are the old ones
  (`rollout_correction.bypass_mode=True`, no recomputation: what ours does);
- the reward: bench/rewards.py's `distinct_share` of each decoded completion, as ours scores it
  (`verl_distinct_share`, loaded by verl from the file by path).

verl's speed settings, from its performance-tuning guide: the hybrid engine (trainer and vLLM on
the same GPUs, vLLM asleep while the trainer trains) for `on`; `use_dynamic_bsz=True` with
`ppo_max_token_len_per_gpu` (`--max-token-len`, default 12,288: 17 sequences of 719 tokens,
near TRL's micro-batch of 16 that ran on one H200 without checkpointing; the guide asks for at
least 2 x (prompt + response)), no gradient checkpointing (`--gradient-checkpointing off`,
the default; on where memory is short), FSDP2 (`strategy=fsdp2`), vLLM with CUDA graphs
(`enforce_eager=False`), tensor parallel 1 (one replica a GPU; verl's default is 2),
`gpu_memory_utilization` 0.6 (`--rollout-memory`; the guide's 0.5-0.7), prefix caching and
chunked prefill on (verl's defaults); fused kernels for the log-probs (`--fused-kernels on`:
`model.use_fused_kernels=True`, `fused_kernel_options.impl_backend=torch`, the best-practices
guide's setting: the output projection and the log-probs in chunks, no whole-vocabulary logits),
which matters here: without the flash-attn package verl 0.9.1's plain path takes the log-probs
of bf16 logits in a Python loop over every token (`logprobs_from_logits_v2`), about 92,000
iterations a pass, and its first runs here (bench/results/gpu_h200x2_2026-11-30e-verl-tools)
trained at an MFU of 0.073 with it; and the reference's forward-only micro-batches at three
times the trainer's tokens (`ref.log_prob_max_token_len_per_gpu`, `--ref-token-len`; the
guide: forward-only limits can exceed the training one), fewer copies of its weights from the
host (verl keeps a forward-only model offloaded to CPU memory between micro-batches); vLLM
without a tokenizer (`--detokenize off`: `skip_tokenizer_init` through
`rollout.engine_kwargs.vllm`, which verl applies after its server's own `False`; its rollout
config's default is True), as ours and TRL's bench generate: verl reads token ids back and
decodes for the reward itself, while vLLM detokenizing this tokenizer's filler ids, which decode
to nothing, decodes each whole sequence again at every token (bench/detokenize_cost.py; most
likely most of the 20 s of generation in a 27 s step in bench/results/gpu_h200_2026-12-01d-verl). No validation, no checkpoint, console
and file loggers.

Where verl's run differs from ours (also under `differences` in the JSON):
- attention: SDPA in the trainer (`override_config.attn_implementation=sdpa`): verl's default,
  flash_attention_2, needs the flash-attn package, which the GPU machine does not have (its
  wheels are built for a CUDA and torch of their own);
- no sequence packing (`use_remove_padding=False`; `--remove-padding on` packs): the guide
  advises packing to drop padding, and here there is none (every prompt is 207 tokens, every
  completion 512), while without a varlen kernel transformers keeps packed sequences apart
  with an SDPA mask over the whole micro-batch (checked: correct with verl's `use_cache=False`),
  whose attention grows with the micro-batch's tokens instead of each sequence's 719;
- micro-batches: by tokens (`use_dynamic_bsz`), not ours' fixed micro-batches of the plan's size
  (`tokens_per_micro_batch` in our run's settings: 16,384 or 8,192 tokens on one H200);
- `off` (one step off-policy) is verl's one_step_off_policy trainer: vLLM on GPUs of its own
  (half of `--gpus`, `rollout.n_gpus_per_node`), the trainer on the rest, weights sent over NCCL
  (`checkpoint_engine.backend=nccl`), generation of step k+1 overlapping training on step k; it
  needs 2 GPUs or more. On one GPU `colocate-async` is verl's asynchronous trainer on shared
  GPUs (`trainer.v1.trainer_mode=colocate_async`, one warm-up batch, partial rollouts): not the
  same schedule as ours' one-step-off plan on one GPU, and labelled so;
- the KL estimator is clamped ([-10, 10]; ours is not);
- compilation: none in verl's model (its `use_torch_compile` covers the entropy alone, not
  computed here), where ours compiles the trainer's and the reference's models;
- log-probs: verl's fused kernels (torch backend, chunked), where ours compiles the log-softmax
  over the output projection's bf16 logits;
- verl reorders a step's sequences to balance tokens across ranks (`trainer.balance_batch`).

Step time is verl's `timing_s/step` (generation, reward, reference, update and, in verl 0.9.1,
the weight sync into vLLM); samples/s per GPU = 128 / mean step time / GPUs, the first
`--warmup` steps left out (verl's first step carries its compiles and CUDA-graph captures).
Tokens/s per GPU use the prompt and mean response lengths verl logs. The section (default
"verl") is merged into `--out` as trl_grpo.py merges its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from trl_grpo import (  # noqa: E402  (bench/ is this script's folder)
    CLIP_HIGH,
    CLIP_LOW,
    KL_BETA,
    LEARNING_RATE,
    PLAIN_CHAT_TEMPLATE,
    fail,
    prompts,
)

ENTRY = {
    "on": "verl.trainer.main_ppo",
    "off": "verl.experimental.one_step_off_policy.main_ppo",
    "colocate-async": "verl.trainer.main_ppo",
}
REWARD_FILE = ROOT / "bench" / "rewards.py"
REWARD_NAME = "verl_distinct_share"
# The step records' keys the section keeps besides every `timing_s/...` (verl's names:
# verl/trainer/ppo/metric_utils.py and the trainers).
KEPT = (
    "perf/throughput",
    "perf/total_num_tokens",
    "perf/max_memory_allocated_gb",
    "response_length/mean",
    "prompt_length/mean",
    "critic/score/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
)


def work_dir() -> Path:
    """/dev/shm where it has room for the model folder beside Ray's object store, else the
    temporary folder. Runs side by side on one host share it (the model is written once)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 20e9:
        return shm / "verl-bench"
    return Path(tempfile.gettempdir()) / "verl-bench"


def write_data(path: Path, count: int, prompt_tokens: int) -> int:
    """A parquet of `count` rows as verl's RLHFDataset reads them: `prompt` one user message (an
    arith question cut or padded to prompt_tokens - 1 characters; the chat template adds <bos>),
    `data_source`, `reward_model.ground_truth` (unused: the reward scores the completion only),
    `extra_info.index`. Returns the rows written."""
    import pandas as pd

    rows = [
        {
            "data_source": "builtin:arith",
            "prompt": [{"role": "user", "content": text}],
            "ability": "arith",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": i},
        }
        for i, text in enumerate(prompts(count, prompt_tokens))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    pd.DataFrame(rows).to_parquet(partial)
    partial.replace(path)  # a run beside this one may be reading the same rows
    return len(rows)


def split_gpus(policy: str, gpus: int) -> tuple[int, int]:
    """(trainer GPUs, rollout GPUs of their own) for the policy mode; 0 rollout GPUs: shared."""
    if policy != "off":
        return gpus, 0
    if gpus < 2:
        fail(
            "--policy off is verl's one_step_off_policy trainer, which puts vLLM on GPUs of its "
            "own: it needs 2 GPUs or more (on one GPU: --policy colocate-async)"
        )
    rollout = gpus // 2
    return gpus - rollout, rollout


def overrides(args: argparse.Namespace, work: Path) -> list[str]:
    """The Hydra overrides of the run (verl's key=value command-line arguments)."""
    trainer_gpus, rollout_gpus = split_gpus(args.policy, args.gpus)
    data = work / "train.parquet"
    per_step = args.prompts_per_step * args.group_size
    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    model = "actor_rollout_ref.model"
    out = [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=True",
        "algorithm.use_kl_in_reward=False",
        "algorithm.rollout_correction.bypass_mode=True",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={args.prompts_per_step}",
        f"data.max_prompt_length={args.prompt_tokens}",
        f"data.max_response_length={args.response_tokens}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.shuffle=False",
        f"{model}.path={work / 'model'}",
        f"{model}.use_remove_padding={args.remove_padding == 'on'}",
        f"{model}.enable_gradient_checkpointing={args.gradient_checkpointing == 'on'}",
        f"+{model}.override_config.attn_implementation={args.attention}",
        f"{actor}.strategy=fsdp2",
        f"{actor}.optim.lr={LEARNING_RATE}",
        f"{actor}.optim.weight_decay=0.0",
        f"{actor}.ppo_mini_batch_size={args.prompts_per_step}",
        f"{actor}.ppo_epochs=1",
        f"{actor}.use_dynamic_bsz=True",
        f"{actor}.ppo_max_token_len_per_gpu={args.max_token_len}",
        f"{actor}.use_kl_loss=True",
        f"{actor}.kl_loss_coef={KL_BETA}",
        f"{actor}.kl_loss_type=low_var_kl",
        f"{actor}.clip_ratio_low={CLIP_LOW}",
        f"{actor}.clip_ratio_high={CLIP_HIGH}",
        f"{actor}.loss_agg_mode=seq-mean-token-mean",
        f"{actor}.entropy_coeff=0",
        f"{model}.use_fused_kernels={args.fused_kernels == 'on'}",
        f"{model}.fused_kernel_options.impl_backend=torch",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={args.ref_token_len}",
        f"{actor}.fsdp_config.param_offload=False",
        f"{actor}.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.ref.fsdp_config.param_offload=False",
        f"{rollout}.name=vllm",
        f"{rollout}.mode=async",
        f"{rollout}.n={args.group_size}",
        f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.gpu_memory_utilization={args.rollout_memory}",
        f"{rollout}.ignore_eos=True",
        f"{rollout}.temperature=1.0",
        f"{rollout}.top_p=1.0",
        f"{rollout}.top_k=-1",
        f"{rollout}.enforce_eager=False",
        f"{rollout}.calculate_log_probs=True",
        # vLLM's own throughput lines in the log (a diagnostic: off is verl's default)
        f"{rollout}.disable_log_stats={args.vllm_stats == 'off'}",
        f"reward.custom_reward_function.path={REWARD_FILE}",
        f"reward.custom_reward_function.name={REWARD_NAME}",
        "trainer.logger=[console,file]",
        # a Ray cluster of its own (address=local: never one found on the host, as a run beside
        # this one has), without the dashboard (nothing reads it; two would want one port)
        "+ray_kwargs.ray_init.address=local",
        "+ray_kwargs.ray_init.include_dashboard=False",
        "trainer.project_name=forgesky-bench",
        f"trainer.experiment_name=verl-{args.policy}-{args.gpus}gpu",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={trainer_gpus}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={work / 'checkpoints'}",
    ]
    if args.detokenize == "off":
        # verl's rollout config defaults skip_tokenizer_init to True, but its vLLM server passes
        # False; engine_kwargs are applied after it. verl reads token ids back and decodes for
        # the reward with its own tokenizer, so nothing it uses comes from vLLM's text.
        out.append(f"+{rollout}.engine_kwargs.vllm.skip_tokenizer_init=True")
    if args.vllm_stats == "on":
        # verl starts Ray with VLLM_LOGGING_LEVEL=WARN, which hides vLLM's throughput lines;
        # the job's runtime_env given here wins over verl's default (main_ppo's merge)
        env = "+ray_kwargs.ray_init.runtime_env.env_vars"
        # quoted: Ray takes strings only, and Hydra would make 1 an int
        out += [f"{env}.VLLM_LOGGING_LEVEL=INFO", f"{env}.VLLM_LOG_STATS_INTERVAL='1'"]
    if per_step % trainer_gpus:
        fail(f"{per_step} completions a step do not split over {trainer_gpus} trainer GPUs")
    if args.policy == "off":
        # one_step_off_ppo_trainer.yaml: vLLM on rollout.n_gpus_per_node GPUs of its own
        # (hybrid engine off), weights over NCCL, the rollout's log-probs as the old ones.
        out += [
            "actor_rollout_ref.hybrid_engine=False",
            "rollout.nnodes=1",
            f"rollout.n_gpus_per_node={rollout_gpus}",
            # Hydra's searchpath in that file is relative to verl's source tree; this finds
            # ppo_trainer.yaml inside the installed package from any folder.
            "hydra.searchpath=[pkg://verl.trainer.config]",
        ]
    elif args.policy == "colocate-async":
        out += ["trainer.v1.trainer_mode=colocate_async"]
    return out


def differences(args: argparse.Namespace) -> dict[str, str]:
    """Every setting of the run that is not ours' (bench/gpu_grpo.py grpo, qwen3-1.7b plan)."""
    out = {
        "attention": f"{args.attention} in the trainer (verl's default flash_attention_2 needs "
        "flash-attn, not on the machine)",
        "packing": "use_remove_padding="
        + (
            "True: packed rows, an SDPA mask over each micro-batch"
            if args.remove_padding == "on"
            else "False: rows of 719 tokens, none padded (verl's guide advises packing)"
        ),
        "micro_batches": f"by tokens: use_dynamic_bsz, at most {args.max_token_len} a GPU "
        "(ours: fixed micro-batches of the plan's tokens_per_micro_batch)",
        "gradient_checkpointing": args.gradient_checkpointing,
        "kl_estimator": "low_var_kl: k3 clamped to [-10, 10] (ours: k3 unclamped)",
        "compile": "none in verl's model (its use_torch_compile covers the entropy alone, not "
        "computed here); ours compiles the trainer's and the reference's models",
        "log_probs": (
            "verl's fused kernels, torch backend: chunks of the output projection and log-probs"
            if args.fused_kernels == "on"
            else "whole-vocabulary bf16 logits, log-probs row by row in Python (no flash-attn)"
        )
        + " (ours: the log-softmax compiled over the output projection's bf16 logits)",
        "reference_micro_batches": f"at most {args.ref_token_len} tokens (forward only; its "
        "weights offloaded to the host between micro-batches, verl's forward-only default)",
        "sharding": "FSDP2 (verl's fsdp2 strategy) over the trainer GPUs",
        "rollout_memory": f"vLLM gpu_memory_utilization {args.rollout_memory}",
        "batch_order": "sequences reordered to balance tokens across ranks (trainer.balance_batch, "
        "verl's default)",
        "detokenization": (
            "none in vLLM (skip_tokenizer_init through rollout.engine_kwargs.vllm, as verl's "
            "rollout config's own default asks and ours and TRL's bench generate)"
            if args.detokenize == "off"
            else "vLLM detokenizes every completion as it grows (verl's vLLM server's setting); "
            "with this tokenizer's filler ids, which decode to nothing, each new token "
            "re-decodes the whole sequence"
        ),
        "step_wait": "verl 0.9.1's trainer polls its replay buffer every 2 s for the step's "
        "samples (timing_s/gen in steps of 2 s); ours waits on the generator's reply",
    }
    if args.policy == "off":
        trainer_gpus, rollout_gpus = split_gpus(args.policy, args.gpus)
        out["layout"] = (
            f"one_step_off_policy: vLLM on {rollout_gpus} GPU(s) of its own, the trainer on "
            f"{trainer_gpus}, weights over NCCL each step"
        )
    elif args.policy == "colocate-async":
        out["layout"] = (
            "v1 colocate_async: trainer and vLLM share the GPUs, one warm-up batch, partial "
            "rollouts (ours one step off on one GPU: a generator and a trainer process)"
        )
    else:
        out["layout"] = "hybrid engine: trainer and vLLM on the same GPUs, vLLM asleep in updates"
    return out


_CONSOLE = re.compile(r"^step:(\d+) - (.*)$")
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(nan|inf)$")


def parse_console(text: str) -> list[dict[str, Any]]:
    """verl's console lines (`step:N - key:value - ...`, verl/utils/logger/aggregate_logger.py)
    as records `{"step": N, "data": {key: value}}`; values that are not numbers stay strings."""
    records = []
    for line in text.splitlines():
        match = _CONSOLE.match(line.strip())
        if not match:
            continue
        data: dict[str, Any] = {}
        for item in match.group(2).split(" - "):
            key, sep, value = item.partition(":")
            if not sep:
                continue
            data[key] = float(value) if _NUMBER.match(value) else value
        records.append({"step": int(match.group(1)), "data": data})
    return records


def parse_file_log(text: str) -> list[dict[str, Any]]:
    """verl's file logger's JSON lines (`{"step": N, "data": {...}}`, verl/utils/tracking.py);
    a line cut by a killed run is skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record and isinstance(record.get("data"), dict):
            records.append(record)
    return records


def timing_keys(steps: list[dict[str, Any]]) -> list[str]:
    """The `timing_s/...` keys of the steps' records, in their first order."""
    return list(dict.fromkeys(k for s in steps for k in s if k.startswith("timing_s/")))


def step_figures(
    records: list[dict[str, Any]], warmup: int, completions: int, gpus: int
) -> dict[str, Any]:
    """Step times from verl's `timing_s/step` (one record a step, the last of a step kept), the
    first `warmup` steps left out of the means; samples and tokens (prompt + response) per
    GPU-second."""
    from gpu_grpo import mean, per

    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        if "timing_s/step" in record["data"]:
            by_step[int(record["step"])] = record["data"]
    steps = [by_step[k] for k in sorted(by_step)]
    measured = steps[warmup:] or steps

    def average(key: str) -> float | None:
        return mean([float(s[key]) for s in measured if isinstance(s.get(key), (int, float))])

    step_s = average("timing_s/step")
    seconds = step_s * gpus if step_s else None
    prompt_tokens = average("prompt_length/mean")
    response_tokens = average("response_length/mean")
    tokens = None if prompt_tokens is None else prompt_tokens + (response_tokens or 0)
    return {
        "steps": len(steps),
        "warmup_steps": len(steps) - len(measured),
        "measured_steps": len(measured) if steps else 0,
        "step_times_s": [s["timing_s/step"] for s in steps],
        "step_s": step_s,
        "samples_per_s_per_gpu": per(completions, seconds),
        "tokens_per_s_per_gpu": per(None if tokens is None else completions * tokens, seconds),
        "verl_throughput_tokens_per_s_per_gpu": average("perf/throughput"),
        "generate_s": average("timing_s/gen"),
        "weight_sync_s": average("timing_s/update_weights")
        or average("timing_s/sync_rollout_weights"),
        "completion_tokens_mean": response_tokens,
        "prompt_tokens_mean": prompt_tokens,
        # every stage verl timed (its names differ between its trainers)
        "timings_s": {k: average(k) for k in timing_keys(measured)},
    }


def name_chatml_end(model_dir: Path) -> int:
    """Rename the tokenizer's last filler token `<|im_end|>`, special, in the folder's
    tokenizer.json: verl's prompt builder for model_type qwen3 (QwenContinuousTokenBuilder)
    refuses a tokenizer without that token, though a single-turn prompt never holds it. The
    vocabulary keeps its size and every other id; the id decodes to nothing either way (filler
    decodes to nothing, a special token is skipped). Returns the id."""
    path = model_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    if "<|im_end|>" in vocab:
        return vocab["<|im_end|>"]
    filler = [k for k in vocab if re.fullmatch(r"<unused_\d+>", k)]
    if not filler:
        fail(f"{path}: no filler token to name <|im_end|>")
    last = max(filler, key=vocab.__getitem__)
    token_id = vocab.pop(last)
    vocab["<|im_end|>"] = token_id
    data["added_tokens"].append(
        {
            "id": token_id,
            "content": "<|im_end|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }  # fmt: skip
    )
    path.write_text(json.dumps(data))
    return token_id


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The model folder (once: later runs reuse it; `--check-config`: trl_grpo.py's tiny CPU
    shape) and the parquet in `work`."""
    from trl_grpo import write_model_dir

    model_dir = work / "model"
    marker = model_dir / "bench_model.json"  # what wrote the folder, inside it
    size = None if args.check_config else args.model_size
    if marker.exists() and json.loads(marker.read_text()).get("size") != size:
        shutil.rmtree(model_dir, ignore_errors=True)
    start = time.perf_counter()
    if not marker.exists():
        shutil.rmtree(model_dir, ignore_errors=True)  # a folder left half-written
        tmp = work / f"model.partial.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model = write_model_dir(tmp, size, chat_template=PLAIN_CHAT_TEMPLATE)
        model["im_end_id"] = name_chatml_end(tmp)
        (tmp / marker.name).write_text(json.dumps({**model, "size": size}))
        try:
            tmp.rename(model_dir)
        except OSError:  # a run beside this one wrote it first: the same weights (seed 0)
            shutil.rmtree(tmp, ignore_errors=True)
    model = json.loads(marker.read_text())
    # a step's prompts more than the steps, twice: colocate-async draws a batch ahead
    rows = write_data(
        work / "train.parquet", args.prompts_per_step * (args.steps + 2), args.prompt_tokens
    )
    return {**model, "build_s": time.perf_counter() - start, "rows": rows}


def check_config(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """What can be checked without GPUs, with verl's own code: verl's entry point, started with
    the run's command line plus Hydra's `--cfg job`, composes its config and prints it without
    running; verl's validate_config and config dataclasses accept it; verl's dataset reads the
    parquet through the model folder's tokenizer (every prompt `--prompt-tokens` long); verl's
    loader finds the reward function, which scores a decoded completion."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import create_rl_dataset, need_critic, need_reference_policy
    from verl.utils import hf_tokenizer
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    given = overrides(args, work)
    command = [sys.executable, "-m", ENTRY[args.policy], *given, *args.extra, "--cfg", "job"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=work)
    if proc.returncode != 0:
        fail(f"verl's Hydra config did not compose:\n{proc.stderr[-3000:]}")
    config = OmegaConf.create(proc.stdout)
    if args.policy == "off":
        # what one_step_off_policy/main_ppo.py's main does before it validates
        config.actor_rollout_ref.rollout.nnodes = config.rollout.nnodes
        config.actor_rollout_ref.rollout.n_gpus_per_node = config.rollout.n_gpus_per_node
    use_ref = need_reference_policy(config)
    validate_config(config=config, use_reference_policy=use_ref, use_critic=need_critic(config))
    OmegaConf.resolve(config)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    tokenizer = hf_tokenizer(str(work / "model"))
    dataset = create_rl_dataset(
        config.data.train_files, config.data, tokenizer, None, is_train=True
    )
    # the agent loop's prompt tokens: verl's Continuous Token builder for the model's type
    # (config.json's model_type, qwen3), as verl/experimental/agent_loop/agent_loop.py builds it
    model_type = json.loads((work / "model" / "config.json").read_text())["model_type"]
    builder = create_continuous_token_builder(tokenizer, hf_model_type=model_type)
    first = builder.build_initial_tokens(dataset[0]["raw_prompt"])
    lengths = sorted(
        {len(builder.build_initial_tokens(dataset[i]["raw_prompt"])) for i in range(len(dataset))}
    )
    reward = get_custom_reward_fn(config)
    if reward is None:
        fail("verl found no custom reward function in the composed config")
    # characters, then a filler id (it decodes to nothing), as a random-weight model samples
    ids = [*range(3, 40), *range(3, 20), len(tokenizer) - 1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    score = reward(data_source="builtin:arith", solution_str=text, ground_truth="", extra_info={})
    return {
        "mode": "check_config",
        "entry": ENTRY[args.policy],
        "command": command,
        "reference_model": use_ref,
        "actor_strategy": actor.strategy,
        "dynamic_bsz": actor.use_dynamic_bsz,
        "ppo_max_token_len_per_gpu": actor.ppo_max_token_len_per_gpu,
        "clip_ratio": [actor.clip_ratio_low, actor.clip_ratio_high],
        "kl": [actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type],
        "loss_agg_mode": actor.loss_agg_mode,
        "optimizer": [actor.optim.lr, actor.optim.weight_decay, actor.grad_clip],
        "gradient_checkpointing": config.actor_rollout_ref.model.enable_gradient_checkpointing,
        "attn_implementation": config.actor_rollout_ref.model.override_config.attn_implementation,
        "rollout": {
            "n": rollout.n,
            "tensor_model_parallel_size": rollout.tensor_model_parallel_size,
            "ignore_eos": rollout.ignore_eos,
            "prompt_length": rollout.prompt_length,
            "response_length": rollout.response_length,
            "gpu_memory_utilization": rollout.gpu_memory_utilization,
            "n_gpus_per_node": rollout.n_gpus_per_node,
            # what verl's vLLM server adds to its own arguments (skip_tokenizer_init)
            "vllm_engine_kwargs": OmegaConf.to_container(
                config.actor_rollout_ref.rollout.engine_kwargs.vllm
            ),
        },
        # verl's own runtime_env has no env_vars key unless --vllm-stats adds one
        "ray_env_vars": OmegaConf.to_container(
            OmegaConf.select(
                config,
                "ray_kwargs.ray_init.runtime_env.env_vars",
                default=OmegaConf.create({}),
            )
        ),
        "trainer_gpus": config.trainer.n_gpus_per_node,
        "hybrid_engine": config.actor_rollout_ref.hybrid_engine,
        "trainer_mode": config.trainer.v1.trainer_mode,
        "bypass_mode": config.algorithm.rollout_correction.bypass_mode,
        "dataset_rows": len(dataset),
        "prompt_tokens": lengths,
        "prompt_builder": type(builder).__name__,
        "first_prompt_starts": tokenizer.decode(first[:12]),
        "reward_of_sample": score,
        "sample_completion": text,
    }


def run(args: argparse.Namespace, work: Path, log: Path) -> dict[str, Any]:
    """verl as a subprocess (its own Ray cluster), then the figures from its step records."""
    from gpu_grpo import gpu_info, versions

    model = prepare(args, work)
    metrics = work / f"metrics-{args.policy}-{args.gpus}-{os.getpid()}.jsonl"
    metrics.unlink(missing_ok=True)
    # the file logger writes where VERL_FILE_LOGGER_PATH says, in verl's task runner (a Ray
    # actor): set for Ray's workers too, not only in this process's environment
    logger_path = f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}"
    command = [
        sys.executable, "-m", ENTRY[args.policy], *overrides(args, work), logger_path,
        *args.extra,
    ]  # fmt: skip
    env = {
        **os.environ,
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    print("verl:", " ".join(command), flush=True)
    start = time.perf_counter()
    # verl's output goes to this process's output line by line (the run's one log) and to
    # `log`; verl and the Ray cluster it starts form a process group of their own, ended with
    # this process (a run cut by its time limit leaves no Ray process on the GPUs)
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=work,
        text=True, errors="replace", start_new_session=True,
    )  # fmt: skip

    def end(*_: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, end)
    try:
        with log.open("w") as sink:
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                sys.stdout.write(line)
        proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # Ray's raylet and workers, if any are left
    wall_s = time.perf_counter() - start
    text = log.read_text(errors="replace")
    records = parse_file_log(metrics.read_text()) if metrics.exists() else []
    source = "file"
    if not records:
        records, source = parse_console(text), "console"
    completions = args.prompts_per_step * args.group_size
    figures = step_figures(records, args.warmup, completions, args.gpus)
    trainer_gpus, rollout_gpus = split_gpus(args.policy, args.gpus)
    return {
        "exit_code": proc.returncode,
        "device": gpu_info(),
        "versions": versions(("torch", "verl", "vllm", "transformers", "ray", "tensordict")),
        "date": time.strftime("%Y-%m-%d"),
        "mode": "gpu",
        "system": "verl",
        "policy": args.policy,
        "entry": ENTRY[args.policy],
        "model_size": args.model_size,
        "model": model,
        "settings": {
            "overrides": overrides(args, work) + list(args.extra),
            "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size,
            "prompt_tokens": args.prompt_tokens,
            "response_tokens": args.response_tokens,
            "trainer_gpus": trainer_gpus,
            "rollout_gpus": rollout_gpus,
            "reward": REWARD_NAME,
        },
        "differences": differences(args),
        "gpus": args.gpus,
        "processes": args.gpus,
        "completions_per_step": completions,
        "wall_s": wall_s,
        "records_from": source,
        **figures,
        "policy_staleness_mean": 0.0 if args.policy == "on" else None,
        "records": [
            {
                "step": r["step"],
                **{k: v for k, v in r["data"].items() if k in KEPT or k.startswith("timing_s/")},
            }
            for r in records
        ],
    }


def merge(out: Path, section: dict[str, Any], name: str) -> None:
    from trl_grpo import merge as merge_section

    merge_section(out, section, name)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=1, help="GPUs of this host verl runs on")
    p.add_argument(
        "--policy",
        choices=sorted(ENTRY),
        default="on",
        help="on: main_ppo, hybrid engine; off: one_step_off_policy (2 GPUs or more); "
        "colocate-async: v1 colocate_async on shared GPUs",
    )
    p.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out (default 2)")
    p.add_argument("--model-size", default="1.7b", help="a qwen3 size in recipes/architectures.py")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=207, help="<bos> + characters")
    p.add_argument("--response-tokens", type=int, default=512)
    p.add_argument("--max-token-len", type=int, default=12288, help="ppo_max_token_len_per_gpu")
    p.add_argument("--rollout-memory", type=float, default=0.6, help="vLLM's share of a GPU")
    p.add_argument(
        "--fused-kernels", choices=["on", "off"], default="on",
        help="verl's fused log-prob kernels (torch backend): on, the best-practices guide's "
        "setting; off, the whole-vocabulary path (a Python loop a token without flash-attn)",
    )  # fmt: skip
    p.add_argument(
        "--vllm-stats", choices=["on", "off"], default="off",
        help="on: vLLM's engine logs its throughput (rollout.disable_log_stats=False), to see "
        "what of verl's timing_s/gen is sampling",
    )  # fmt: skip
    p.add_argument(
        "--detokenize", choices=["on", "off"], default="off",
        help="off: vLLM without a tokenizer (skip_tokenizer_init), as verl's rollout config "
        "defaults and ours runs; on: verl's vLLM server's own setting, which with this "
        "tokenizer's empty filler re-decodes each whole sequence at every token",
    )  # fmt: skip
    p.add_argument(
        "--ref-token-len", type=int, default=36864,
        help="the reference's forward-only tokens a micro-batch (log_prob_max_token_len_per_gpu)",
    )  # fmt: skip
    p.add_argument("--gradient-checkpointing", choices=["on", "off"], default="off")
    p.add_argument(
        "--remove-padding",
        choices=["on", "off"],
        default="off",
        help="use_remove_padding: pack the micro-batch's sequences (off: no padding to remove "
        "here, and SDPA would mask over the whole packed micro-batch)",
    )
    p.add_argument("--attention", default="sdpa", help="the trainer's attn_implementation")
    p.add_argument("--out", default=None, help="default bench/results/gpu_grpo.json")
    p.add_argument("--section", default="verl", help="the JSON section this run goes in")
    p.add_argument("--log", default=None, help="verl's output (default: the work folder)")
    p.add_argument("--work", default=None, help="default /dev/shm/verl-bench")
    p.add_argument(
        "--check-config",
        action="store_true",
        help="no GPU: compose and validate verl's config, load the data and the reward",
    )
    p.add_argument("extra", nargs="*", help="more Hydra overrides for verl (key=value)")
    return p


def main() -> int:
    args = parser().parse_args()
    if args.gpus < 1:
        fail(f"--gpus must be 1 or more, not {args.gpus}")
    if args.steps <= args.warmup:
        fail(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.prompt_tokens < 2:
        fail("--prompt-tokens must be at least 2 (<bos> and one character)")
    if not 0 < args.rollout_memory < 1:
        fail("--rollout-memory is a share of the GPU, between 0 and 1")
    bad = [e for e in args.extra if "=" not in e]
    if bad:
        fail(f"extra arguments are Hydra overrides key=value, not {bad[0]!r}")
    if args.max_token_len < 2 * (args.prompt_tokens + args.response_tokens):
        fail(
            f"--max-token-len {args.max_token_len} is under twice a sequence "
            f"({2 * (args.prompt_tokens + args.response_tokens)}), verl's guide's floor"
        )
    from recipes.architectures import architecture
    from recipes.errors import UserError

    try:
        architecture("qwen3", args.model_size)
    except UserError as e:
        fail(f"--model-size: {e}")
    split_gpus(args.policy, args.gpus)
    work = Path(args.work) if args.work else work_dir()
    work.mkdir(parents=True, exist_ok=True)
    if args.check_config:
        model = prepare(args, work)
        result = {**check_config(args, work), "model": model}
        print(json.dumps(result, indent=2))
        return 0
    out = Path(args.out or ROOT / "bench/results/gpu_grpo.json")
    log = Path(args.log) if args.log else work / f"verl-{args.policy}-{args.gpus}-{os.getpid()}.log"
    section = run(args, work, log)
    merge(out, section, args.section)
    summary = {k: v for k, v in section.items() if k not in ("records", "settings", "model")}
    print(json.dumps(summary, indent=2))
    print(f"wrote the {args.section!r} section of {out}")
    return 0 if section["exit_code"] == 0 and section["samples_per_s_per_gpu"] else 1


if __name__ == "__main__":
    sys.exit(main())
