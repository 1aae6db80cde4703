"""Names the launcher and the runtime must agree on, defined once: model families, built-in
losses and rewards, the tasks forgesky ships, and the port every node of a multi-node run
listens on."""

from __future__ import annotations

# Model families with an architecture table (recipes/architectures.py) and a runtime model
# folder (runtime/models/<family>/).
FAMILIES: tuple[str, ...] = ("qwen3", "llama3")

# The projections a LoRA adapter may wrap, by their Hugging Face module names (the names PEFT
# and vLLM use), the same for every family; `all-linear` in a recipe means all of them (never
# the embedding or the output head, as in PEFT).
LORA_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip
ALL_LINEAR = "all-linear"

# Policy losses built into the runtime (runtime/grpo/losses.py); a recipe may also name its own
# as module:function.
LOSSES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo")
# How a loss turns per-token terms into one number (runtime/grpo/losses.py), and each built-in's.
AGGREGATIONS: tuple[str, ...] = ("sequence_mean", "token_mean", "constant")
LOSS_AGGREGATION: dict[str, str] = {
    "grpo": "sequence_mean",
    "dr_grpo": "constant",
    "dapo": "token_mean",
    "gspo": "sequence_mean",
    "cispo": "token_mean",
    "sapo": "sequence_mean",
}

# Rewards built into the runtime (runtime/tasks/rewards.py); a recipe may also name a shipped
# task's (builtin:<task>) or its own (module:function).
BUILTIN_REWARDS: tuple[str, ...] = ("math", "gsm8k_format", "format")

# vCPUs a CPU recipe's node has at the least: launch asks SkyPilot for `cpus: 8+` (the runtime
# starts one process per service, recipes/layouts.py cpu_plan).
CPU_NODE_VCPUS = 8

# Environments shipped with the runtime (runtime/environments/host.py BUILTINS): a recipe's env.name
# `builtin:<name>` names one; its own is `module:Class`, an OpenEnv Environment.
BUILTIN_ENVIRONMENTS: tuple[str, ...] = ("python", "tiny-tools")

# Tasks shipped with the runtime (runtime/tasks/<name>/): `builtin:<name>` in a recipe's
# dataset.path, model.tokenizer or reward names one of them.
BUILTIN_TASKS: tuple[str, ...] = ("tiny", "arith", "tiny-tools")
# The model families whose tool-call format the runtime reads (runtime/episodes/formats.py).
TOOL_FAMILIES: tuple[str, ...] = ("qwen3", "llama3")
# The splits each of them has: "train" to learn from, "test" held out for evaluation.
BUILTIN_SPLITS: tuple[str, ...] = ("train", "test")

# Committed checkpoints a run keeps (the newest; older ones are deleted as new ones commit).
KEPT_CHECKPOINTS = 3

# Monarch's own launchers use this port for their worker loops (monarch/_src/job/spmd.py).
WORKER_PORT = 26600
WORKER_PORT_ENV = "FORGESKY_WORKER_PORT"
