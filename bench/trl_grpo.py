"""TRL's GRPOTrainer with vLLM colocated, on a random-weight Qwen3: the baseline for gpu_grpo.py.

    python bench/trl_grpo.py [--steps 8] [--warmup 2] [--model-size 1.7b] [--out FILE]
    python bench/trl_grpo.py --dry-cpu     # the CPU check: real TRL, tiny model, no vLLM

On the GPU machine: `bash scripts/gpu/device_run.sh trl` (scripts/gpu/README.md). The run has
the shape of `gpu_grpo.py grpo` on the qwen3-1.7b recipe, without the Hub:

- model: `Qwen3Config` with recipes/architectures.py's numbers, `from_config` random weights,
  saved in bf16 with the project's Hub-free tokenizer (runtime/tasks/arith, one token per character,
  padded to the 151936-id vocabulary); TRL loads that folder, its policy in fp32 (TRL's default,
  like our trainer's fp32 state) under bf16 autocast, vLLM in bf16.
- step: 16 prompts x 8 completions = 128 per optimizer step, one generation per step
  (TRL counts completions: per_device_train_batch_size 8 x gradient_accumulation_steps 16 =
  128 on one GPU, and steps_per_generation defaults to gradient_accumulation_steps). A
  micro-batch of 8 is 5120 tokens (ours: the plan's `tokens_per_micro_batch`); on an out-of-memory error try
  `--micro-batch 4` or `--vllm-memory 0.25`. Prompts: builtin:arith problems cut or padded to
  127 characters, + <bos> = 128 tokens (the grpo run's templated prompts average about 207:
  `--prompt-tokens 207` matches that instead). Completions: 512 tokens, never stopped early
  (vLLM `ignore_eos`; no detokenization in vLLM, as our generator runs without a tokenizer).
- loss as the recipe: beta (KL) 0.1, so TRL loads a reference model; clip 0.2 / 0.28;
  loss_type "grpo"; lr 1e-5. Gradient checkpointing on (TRL's GRPO default; ours checkpoints
  every block too). vLLM gets 0.3 of the GPU (TRL's default); the reward is plain Python (the
  share of distinct token ids in a completion: cheap, and it varies, so advantages are not 0).

`--lora-rank 16` trains a LoRA adapter instead (TRL's `peft_config`: PEFT's `LoraConfig` on
all-linear, alpha 2 x rank unless `--lora-alpha`, no dropout), the side of `gpu_grpo.py grpo
--recipe qwen3-8b-lora`: TRL then loads the model in bf16 (`--model-dtype`; the adapter is fp32,
PEFT's autocast), has no reference model (the base with the adapter off gives the reference
log-probs), and before each generation merges the adapter into the base and sends vLLM the
merged weights.

`--trainer async` runs TRL's asynchronous GRPO trainer (`trl.experimental.async_grpo`) instead,
as its docs set it up: a `vllm serve` process of its own on the last visible GPU
(`VLLM_SERVER_DEV_MODE=1`, weights sent over NCCL: `--weight-transfer-config
'{"backend":"nccl"}'`, `--server-memory` of that GPU, CUDA graphs on), the trainer on the first,
completions generated continuously while the trainer trains on samples up to `--max-staleness`
versions old (TRL's default 4; the logs give the staleness each step trained at), weights sent
every step. It takes prompts as chat messages only: each prompt is one user message, rendered
by a chat template that adds <bos> alone (the same tokens as the plain text). Its attention is
a FlashAttention-3 kernel it fetches from the Hugging Face Hub at run time
(`kernels-community/flash-attn3` through the `kernels` package, TRL's `kernels` extra): on a
machine without the Hub, the bench says so before it starts anything. It has no reference model and no KL term (the recipe's 0.1 is not applied), no
importance-sampling switch, and asks vLLM for one completion a request. samples/s per GPU count
both GPUs.

Step time is the wall time between consecutive `on_step_end` callbacks (the first from
`on_train_begin`): generation, weight sync into vLLM, reference and policy passes, optimizer.
samples/s per GPU = 128 / mean step time / processes, the first `--warmup` steps left out.
The "trl" section is merged into `--out` (the JSON gpu_grpo.py writes), with
`forgesky_to_trl_samples_per_s` when a "grpo" section is there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gpu_grpo import gpu_info, mean, per  # noqa: E402  (bench/ is this script's folder)
from rewards import distinct_share_of_ids  # noqa: E402

KL_BETA, CLIP_LOW, CLIP_HIGH, LEARNING_RATE = 0.1, 0.2, 0.28, 1e-5  # recipes/catalog/qwen3-1.7b
# The CPU check: a model that trains in seconds, lengths that keep HF generate quick.
DRY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab=128)


def fail(message: str) -> None:
    """A mistake in the arguments: one line, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def versions() -> dict[str, str]:
    from gpu_grpo import versions as installed

    return installed(("torch", "trl", "vllm", "transformers", "accelerate", "datasets"))


def model_config(size: str | None, tokenizer: Any) -> Any:
    """Qwen3Config of the named size (recipes/architectures.py), or the tiny CPU-check shape."""
    from transformers import Qwen3Config

    from recipes.architectures import architecture

    if size is None:
        d = DRY
        shape = dict(vocab_size=d["vocab"], hidden_size=d["dim"], intermediate_size=d["ffn_dim"],
                     num_hidden_layers=d["n_layers"], num_attention_heads=d["n_heads"],
                     num_key_value_heads=d["n_kv_heads"], head_dim=d["head_dim"],
                     max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
    else:
        a = architecture("qwen3", size)
        shape = dict(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_dim,
                     num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
                     num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim,
                     max_position_embeddings=a.max_seq_len, rms_norm_eps=a.norm_eps,
                     tie_word_embeddings=a.tie_embeddings,
                     rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta})  # fmt: skip
    return Qwen3Config(
        **shape,
        attention_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3ForCausalLM"],
    )


# TRL's async trainer takes conversational prompts only and renders each through the
# tokenizer's chat template; this one adds <bos> and nothing else, so a prompt is the same
# tokens GRPOTrainer gets from the plain text.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
)


def write_model_dir(
    directory: Path, size: str | None, chat_template: str | None = None
) -> dict[str, Any]:
    """Random bf16 weights and the arith tokenizer (with `chat_template`, if given) in
    `directory`, as from_pretrained reads them."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.architectures import architecture
    from runtime.tasks.arith.tokenization import build_tokenizer

    vocab = DRY["vocab"] if size is None else architecture("qwen3", size).vocab_size
    tokenizer = build_tokenizer(vocab)  # every id the model can sample decodes
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = model_config(size, tokenizer)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"params": params, "vocab_size": config.vocab_size, "tokenizer": "builtin:arith"}


def prompts(count: int, prompt_tokens: int) -> list[str]:
    """builtin:arith questions cut or space-padded to prompt_tokens - 1 characters (+ <bos>)."""
    from runtime.tasks.arith import rows

    chars = prompt_tokens - 1
    return [r["question"][:chars].ljust(chars) for r in rows(count=count)]


def timing_callback() -> Any:
    import torch
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Wall-clock marks at train start and after every optimizer step, and the logs."""

        def __init__(self) -> None:
            self.marks: list[float] = []
            self.logs: list[dict[str, Any]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the optimizer step is queued, not done
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append({"step": state.global_step, **(logs or {})})

    return StepTimes()


def timed(owner: Any, name: str, into: list[float]) -> None:
    """Wrap `owner.name` so each call's wall seconds are appended to `into`."""
    import torch

    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            into.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The GRPOConfig arguments of this run (what the JSON reports, and what builds the config)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    completions = args.prompts_per_step * args.group_size
    if completions % (args.micro_batch * world):
        fail(
            f"{completions} completions per step do not split into micro-batches of "
            f"{args.micro_batch} on {world} processes; pick a --micro-batch dividing {completions}"
        )
    if args.dry_cpu:
        # HF generate on the CPU: no ignore_eos there, min_new_tokens does the same.
        generation = {"min_new_tokens": args.response_tokens}
    else:
        generation = {"ignore_eos": True, "detokenize": False}
    if args.optimizer_steps_per_generation < 1:
        fail("--optimizer-steps-per-generation must be at least 1")
    accumulation = completions // (args.micro_batch * world)
    return dict(
        num_generations=args.group_size,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation,
        max_completion_length=args.response_tokens,
        max_steps=args.steps,
        learning_rate=LEARNING_RATE,
        beta=KL_BETA,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        loss_type="grpo",
        temperature=1.0,
        top_p=1.0,
        bf16=True,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        vllm_importance_sampling_correction=args.is_correction == "on",
        # TRL counts micro-batches here: one generation batch serves this many optimizer steps
        steps_per_generation=accumulation * args.optimizer_steps_per_generation,
        use_vllm=not args.dry_cpu,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.vllm_memory,
        vllm_max_model_length=args.prompt_tokens + args.response_tokens,
        generation_kwargs=generation,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=args.dry_cpu,
        **(
            {"model_init_kwargs": {"dtype": args.model_dtype}}
            if args.model_dtype != "float32"
            else {}
        ),
    )


def peft_config(args: argparse.Namespace) -> Any:
    """The LoRA adapter TRL trains (`peft_config`), as the recipe's `model.lora` on all-linear
    (q, k, v, o, gate, up, down; PEFT's "all-linear" leaves the output head out, as ours does);
    None for full-parameter training."""
    if not args.lora_rank:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha or 2 * args.lora_rank,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def step_figures(
    marks: list[float],
    warmup: int,
    completions: int,
    gpus: int,
    prompt_lengths: list[int],
    completion_tokens: float | None,
) -> dict[str, Any]:
    """Step times from the callback's marks (the first `warmup` left out of the mean), and
    samples and tokens (prompt + completion: NeMo-RL's unit) per GPU-second."""
    step_times = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    measured = step_times[warmup:] or step_times
    step_s = mean(measured)
    seconds = step_s * gpus if step_s else None
    return {
        "steps": len(step_times),
        "warmup_steps": len(step_times) - len(measured),
        "measured_steps": len(measured),
        "step_times_s": step_times,
        "step_s": step_s,
        "samples_per_s_per_gpu": per(completions, seconds),
        "tokens_per_s_per_gpu": per(
            completions * (mean(prompt_lengths) + (completion_tokens or 0)), seconds
        ),
    }


def build_trainer(
    cls: Any,
    config: Any,
    model_dir: Path,
    args: argparse.Namespace,
    callback: Any,
    conversational: bool = False,
) -> tuple[Any, float, list[int]]:
    """A TRL trainer of `cls` on the model folder and the bench's prompts (one step's worth more
    than the steps; as one user message each where `conversational`), the seconds it took to
    build, and each prompt's token count."""
    from datasets import Dataset

    texts = prompts(args.prompts_per_step * (args.steps + 1), args.prompt_tokens)
    rows = [{"prompt": [{"role": "user", "content": t}] if conversational else t} for t in texts]
    start = time.perf_counter()
    trainer = cls(
        model=str(model_dir),
        reward_funcs=distinct_share_of_ids,
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[callback],
        **({"peft_config": peft_config(args)} if args.lora_rank else {}),
    )
    init_s = time.perf_counter() - start
    return trainer, init_s, [len(ids) for ids in trainer.processing_class(text=texts)["input_ids"]]


def async_settings(args: argparse.Namespace, server_url: str) -> dict[str, Any]:
    """The AsyncGRPOConfig arguments of a `--trainer async` run (one trainer process)."""
    completions = args.prompts_per_step * args.group_size
    if completions % args.micro_batch:
        fail(f"{completions} completions per step do not split into micro-batches of "
             f"{args.micro_batch}; pick a --micro-batch dividing {completions}")  # fmt: skip
    if args.max_staleness < 0:
        fail("--max-staleness must be 0 or more")
    return dict(
        num_generations=args.group_size,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=completions // args.micro_batch,
        max_completion_length=args.response_tokens,
        max_steps=args.steps,
        learning_rate=LEARNING_RATE,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        temperature=1.0,
        top_p=1.0,
        bf16=True,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        vllm_server_base_url=server_url,
        # a cold vLLM compiles its graphs first (minutes on a fresh machine)
        vllm_server_timeout=900.0,
        max_staleness=args.max_staleness,
        weight_sync_steps=1,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def server_command(model_dir: Path, args: argparse.Namespace, port: int) -> list[str]:
    """`vllm serve` as TRL's async trainer needs it: its model folder under the same name the
    trainer asks for, weights received over NCCL, bf16, CUDA graphs on."""
    return [
        "vllm",
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(args.prompt_tokens + args.response_tokens),
        "--gpu-memory-utilization",
        str(args.server_memory),
        "--weight-transfer-config",
        json.dumps({"backend": "nccl"}),
        "--seed",
        "0",
    ]


def server_env(gpu: str) -> dict[str, str]:
    """The server's environment: the dev endpoints TRL drives (pause, weight transfer) on, its
    own GPU."""
    return {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": gpu}


def gpu_split() -> tuple[str, str]:
    """(trainer GPU, server GPU) of the visible ones: the first and the last."""
    # counted by nvidia-smi, not CUDA: this process's CUDA must start after
    # CUDA_VISIBLE_DEVICES is set
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(gpu_info()["gpus"])]
    if len(ids) < 2:
        fail("--trainer async needs two GPUs: the vLLM server takes one of its own")
    return ids[0], ids[-1]


def wait_ready(server: Any, url: str, log: Path, timeout: float = 900.0) -> float:
    """Seconds until the server answers /health; fails (with its log's tail) if it exits."""
    import urllib.request

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            fail(f"vllm serve exited with {server.returncode} before it was ready:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(2)
    fail(f"vllm serve did not answer {url}/health within {timeout:.0f} s (log: {log})")
    return timeout


# The attention kernel TRL's async trainer loads (trl/experimental/async_grpo/packing.py).
FA3_KERNEL = ("kernels-community/flash-attn3", 1)


def check_attention_kernel() -> None:
    """Fail before the server starts if the async trainer's attention kernel cannot be had."""
    try:
        from kernels import get_kernel

        get_kernel(FA3_KERNEL[0], version=FA3_KERNEL[1])
    except Exception as e:  # noqa: BLE001 - any way of not getting it ends the same
        fail(
            f"--trainer async: TRL's async trainer computes attention with {FA3_KERNEL[0]}, a "
            f"kernel it fetches from the Hugging Face Hub at run time, and it is not to be had "
            f"here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        )


def run_async(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import subprocess

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    check_attention_kernel()
    trainer_gpu, server_gpu = gpu_split()
    os.environ["CUDA_VISIBLE_DEVICES"] = trainer_gpu  # before this process sets up CUDA
    url = f"http://127.0.0.1:{args.server_port}"
    config_args = async_settings(args, url)
    model_dir = work / "model"
    start = time.perf_counter()
    model = write_model_dir(model_dir, args.model_size, chat_template=PLAIN_CHAT_TEMPLATE)
    build_s = time.perf_counter() - start
    log = Path(args.server_log or work / "vllm_serve.log")
    command = server_command(model_dir, args, args.server_port)
    with log.open("w") as sink:
        server = subprocess.Popen(
            command, env=server_env(server_gpu), stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        ready_s = wait_ready(server, url, log)
        config = AsyncGRPOConfig(output_dir=str(work / "out"), **config_args)
        callback = timing_callback()
        trainer, init_s, prompt_lengths = build_trainer(
            AsyncGRPOTrainer, config, model_dir, args, callback, conversational=True
        )
        start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - start
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    completions = args.prompts_per_step * args.group_size
    gpus = 2  # the trainer's and the server's
    logs = [x for x in callback.logs if "loss" in x]
    late = logs[args.warmup :] or logs

    def logged(key: str) -> float | None:
        return mean([x[key] for x in late if x.get(key) is not None])

    length = logged("completions/mean_length")
    return {
        "exit_code": 0,
        "device": gpu_info(),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
        "mode": "gpu_async",
        "model_size": args.model_size,
        "model": model,
        "settings": {
            **config_args,
            "prompts_per_step": args.prompts_per_step,
            "prompt_tokens": sorted(set(prompt_lengths)),
            "policy_dtype": str(trainer.model.dtype).removeprefix("torch."),
            "reference_model": False,
            "reward": distinct_share_of_ids.__name__,
            "server": command,
            "server_gpu": server_gpu,
            "trainer_gpu": trainer_gpu,
        },
        "processes": 1,
        "gpus": gpus,
        "completions_per_step": completions,
        "model_build_s": build_s,
        "server_ready_s": ready_s,
        "init_s": init_s,
        "train_s": train_s,
        **step_figures(callback.marks, args.warmup, completions, gpus, prompt_lengths, length),
        # the versions behind the policy each trained sample was, as TRL logs it
        "policy_staleness_mean": logged("sample/staleness_mean"),
        "max_staleness": args.max_staleness,
        "weight_sync_s": logged("perf/weight_sync_s"),
        "trainer_waited_for_rollouts_s": logged("perf/rollout_wait_s"),
        "completion_tokens_mean": length,
        "logs": callback.logs,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer

    config_args = settings(args)
    model_dir = work / "model"
    start = time.perf_counter()
    model = write_model_dir(model_dir, None if args.dry_cpu else args.model_size)
    build_s = time.perf_counter() - start
    config = GRPOConfig(output_dir=str(work / "out"), **config_args)
    callback = timing_callback()
    # init: model, reference and (on GPU) the vLLM engine
    trainer, init_s, prompt_lengths = build_trainer(GRPOTrainer, config, model_dir, args, callback)
    generate_s: list[float] = []
    sync_s: list[float] = []
    timed(trainer, "_generate", generate_s)
    if config.use_vllm:
        timed(trainer.vllm_generation, "sync_weights", sync_s)

    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    world = trainer.accelerator.num_processes
    completions = args.prompts_per_step * args.group_size
    logs = [x for x in callback.logs if "loss" in x or "reward" in x]
    lengths = [x["completions/mean_length"] for x in logs if "completions/mean_length" in x]
    shown = ("steps_per_generation", "generation_batch_size", "world_size")
    return {
        "exit_code": 0,
        "device": gpu_info(),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
        "mode": "dry_cpu" if args.dry_cpu else "gpu",
        "model_size": "tiny (CPU check)" if args.dry_cpu else args.model_size,
        "model": model,
        "settings": {
            **{k: v for k, v in config_args.items() if k not in ("use_cpu", "disable_tqdm")},
            **{k: getattr(config, k) for k in shown},
            "prompts_per_step": args.prompts_per_step,
            "prompt_tokens": sorted(set(prompt_lengths)),
            "policy_dtype": str(trainer.model.dtype).removeprefix("torch."),
            "reference_model": trainer.ref_model is not None,
            "reward": distinct_share_of_ids.__name__,
            "lora": None
            if not args.lora_rank
            else {
                "rank": args.lora_rank,
                "alpha": args.lora_alpha or 2 * args.lora_rank,
                "targets": "all-linear",
                "trainable_params": sum(
                    p.numel() for p in trainer.model.parameters() if p.requires_grad
                ),
            },
        },
        "processes": world,
        "completions_per_step": completions,
        "model_build_s": build_s,
        "init_s": init_s,
        "train_s": train_s,
        **step_figures(
            callback.marks,
            args.warmup,
            completions,
            world,
            prompt_lengths,
            mean(lengths[args.warmup :] or lengths),
        ),
        # a generation batch serves s optimizer steps: its j-th step (0-based) trains on samples
        # j versions old, (s - 1) / 2 on average; 0 on-policy
        "policy_staleness_mean": (args.optimizer_steps_per_generation - 1) / 2,
        "optimizer_steps_per_generation": args.optimizer_steps_per_generation,
        "generate_s": mean(generate_s[args.warmup :] or generate_s),
        "generate_times_s": generate_s,
        "weight_sync_s": mean(sync_s[args.warmup :] or sync_s),
        "completion_tokens_mean": mean(lengths[args.warmup :] or lengths),
        "logs": callback.logs,
    }


def merge(out: Path, section: dict[str, Any], name: str = "trl") -> None:
    """Put the section into `out` under `name`, keeping the other sections (gpu_grpo.py's
    convention)."""
    result = json.loads(out.read_text()) if out.exists() else {}
    if "device" not in result:
        result.update(device=section["device"], date=section["date"])
    result[name] = section
    if name == "trl":
        ours = (result.get("grpo") or {}).get("samples_per_s_per_gpu")
        result["forgesky_to_trl_samples_per_s"] = per(ours, section.get("samples_per_s_per_gpu"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 8; dry 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out (default 2; dry 1)")
    p.add_argument("--model-size", default="1.7b", help="a qwen3 size in recipes/architectures.py")
    p.add_argument("--prompts-per-step", type=int, default=None, help="default 16; dry 4")
    p.add_argument("--group-size", type=int, default=None, help="completions a prompt; default 8")
    p.add_argument("--micro-batch", type=int, default=None, help="completions a micro-batch; 8")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 128; dry 16")
    p.add_argument("--response-tokens", type=int, default=None, help="default 512; dry 16")
    p.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's share of the GPU")
    p.add_argument("--out", default=None, help="default bench/results/gpu_grpo.json; dry: /tmp")
    p.add_argument("--section", default="trl", help="the JSON section this run's result goes in")
    # Speed tuning as TRL's docs advise (defaults are TRL's own defaults).
    p.add_argument(
        "--gradient-checkpointing",
        choices=["on", "off"],
        default="on",
        help="recompute activations in the backward (TRL's GRPO default: on)",
    )
    p.add_argument(
        "--is-correction",
        choices=["on", "off"],
        default="on",
        help="vllm_importance_sampling_correction: a policy forward pass per generation batch "
        "to reweight by vLLM's log-probs (TRL default on; forgesky takes vLLM's as the old ones)",
    )
    p.add_argument(
        "--optimizer-steps-per-generation",
        type=int,
        default=1,
        help="optimizer steps each generation batch serves (TRL's steps_per_generation = this x "
        "gradient_accumulation_steps; default 1, TRL's); 2: every second step trains on "
        "samples one step old",
    )
    p.add_argument(
        "--trainer",
        choices=["grpo", "async"],
        default="grpo",
        help="grpo: GRPOTrainer, vLLM colocated; async: AsyncGRPOTrainer with `vllm serve` on a "
        "GPU of its own (two GPUs)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        help="async: versions a sample may lag the policy it trains (TRL's default 4)",
    )
    p.add_argument(
        "--server-memory",
        type=float,
        default=0.9,
        help="async: the vLLM server's share of its GPU (vLLM's default 0.9)",
    )
    p.add_argument("--server-port", type=int, default=8011, help="async: the server's port")
    p.add_argument("--server-log", default=None, help="async: where the server's output goes")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train a LoRA adapter of this rank on all-linear through TRL's peft_config "
        "(0: every parameter); the reference is then the base with the adapter off (TRL's way)",
    )
    p.add_argument("--lora-alpha", type=int, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument(
        "--model-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the dtype TRL loads the model in (model_init_kwargs; TRL's default float32, "
        "default bfloat16 with --lora-rank: a frozen base needs no fp32 master copy, as in "
        "TRL's PEFT examples)",
    )
    p.add_argument(
        "--dry-cpu",
        action="store_true",
        help="CPU check: tiny model, HF generate instead of vLLM, short lengths, real TRL",
    )
    args = p.parse_args()
    dry = args.dry_cpu
    defaults = dict(steps=(3, 8), warmup=(1, 2), prompts_per_step=(4, 16), group_size=(4, 8),
                    micro_batch=(4, 8), prompt_tokens=(16, 128), response_tokens=(16, 512))  # fmt: skip
    for name, (on_cpu, on_gpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_cpu if dry else on_gpu)
    if not dry:
        from recipes.architectures import architecture
        from recipes.errors import UserError

        try:
            architecture("qwen3", args.model_size)
        except UserError as e:
            fail(f"--model-size: {e}")
    if args.lora_rank < 0:
        fail("--lora-rank must be 0 (off) or positive")
    if args.model_dtype is None:
        args.model_dtype = "bfloat16" if args.lora_rank else "float32"
    if args.prompt_tokens < 2:
        fail("--prompt-tokens must be at least 2 (<bos> and one character)")
    default_out = Path(tempfile.gettempdir()) / "trl_grpo_dry_cpu.json" if dry else None
    out = Path(args.out or default_out or ROOT / "bench/results/gpu_grpo.json")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.trainer == "async" and args.lora_rank:
        fail("--lora-rank is for --trainer grpo")
    if args.trainer == "async" and dry:
        fail("--trainer async needs GPUs (a vllm serve process); --dry-cpu checks GRPOTrainer")
    work = Path(tempfile.mkdtemp(prefix="trl-grpo-bench-"))
    try:
        section = run_async(args, work) if args.trainer == "async" else run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun, rank 0 alone writes the section (the same figures)
    merge(out, section, args.section)
    summary = {k: v for k, v in section.items() if k not in ("logs", "settings")}
    print(json.dumps(summary, indent=2))
    print(f"wrote the {args.section!r} section of {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
