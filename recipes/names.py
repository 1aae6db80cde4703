"""Names the launcher and the runtime must agree on, defined once: model families, built-in
losses, the tasks forgesky ships, and the port every node of a multi-node run listens on."""

from __future__ import annotations

# Model families with an architecture table (recipes/architectures.py) and a runtime model
# folder (runtime/models/<family>/).
FAMILIES: tuple[str, ...] = ("qwen3", "llama3")

# Policy losses built into the runtime (runtime/grpo.py).
LOSSES: tuple[str, ...] = ("grpo", "dr_grpo", "gspo")

# Tasks shipped with the runtime (runtime/tasks/<name>/): `builtin:<name>` in a recipe's
# dataset.path, model.tokenizer or reward names one of them.
BUILTIN_TASKS: tuple[str, ...] = ("tiny", "arith")

# Monarch's own launchers use this port for their worker loops (monarch/_src/job/spmd.py).
WORKER_PORT = 26600
WORKER_PORT_ENV = "FORGESKY_WORKER_PORT"
