"""The shell that SkyPilot runs on every node: `setup` (install the stack) and `run` (train).

Pure string building, no SkyPilot import: `forgesky render` output and the files in sky/ come
from here, so the exact commands are reviewable in one place.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

# The GPU stack, pinned. vLLM 0.20-0.26 pin torch==2.11.0, so torch follows vLLM; PyPI's Linux
# torch wheel is the CUDA build.
RUNTIME_STACK: tuple[str, ...] = (
    "torch==2.11.0",
    "vllm==0.24.0",
    "torchmonarch==0.7.0",
    "torchtitan==0.3.0",
)
# Its metadata pins torch==2.9.0 and torchmonarch==0.1.2; runtime/compat/torchstore.py bridges
# the difference, so it goes in without dependencies.
TORCHSTORE = "torchstore==0.1.2"
# The uv the node uses to sync the lock: the one tests/test_node_stack.py re-resolves it with
# (pyproject's dev extra), pinned so a node does not take a later one that reads the lock otherwise.
UV = "uv==0.13.9"
VENV = "$HOME/forgesky-venv"
# Exit code of a node run stopped by a signal before it ended (sysexits' EX_TEMPFAIL): a managed
# job recovers on it (job_recovery.recover_on_exit_codes) however many restarts errors allow.
STOPPED_EXIT_CODE = 75
# The nodes' Python and platform: those of the GPU machine the stack was tested on (its image's
# NumPy 2.5 has no Python 3.11 wheels), and the oldest glibc vLLM 0.24's dependencies have
# wheels for. launcher/node-stack.txt is locked for them (scripts/node/lock.py).
PYTHON_VERSION = "3.12"
NODE_PLATFORM = "x86_64-manylinux_2_31"


CHECKOUT_REQUIREMENT = "-e '.[runtime]'"


# Where the node-stack lock (launcher/node-stack.txt) is mounted on the nodes.
LOCK_MOUNT = "/forgesky/node-stack.txt"


def setup_script(project: str = CHECKOUT_REQUIREMENT) -> str:
    """Install uv, a Python venv and exactly the locked stack, from wheels only.

    project: how `uv pip install` names forgesky itself (launcher.source.ProjectSource
    .requirement): the synced checkout editable, a mounted wheel, or a release.
    """
    how = (
        "the synced workdir, installed editable"
        if project == CHECKOUT_REQUIREMENT
        else "from the requirement below"
    )
    uv = f'python3 -m uv pip install --python "{VENV}/bin/python" --no-deps'
    return (
        "\n".join(
            [
                "set -euo pipefail",
                "# uv installs the CUDA stack in about a minute where pip takes several.",
                f"python3 -m pip install --quiet {UV}",
                "# uv's standalone Python: node images often ship an older one.",
                f'[ -x "{VENV}/bin/python" ] || python3 -m uv venv --python {PYTHON_VERSION} "{VENV}"',
                "# Exactly the tested stack: every package pinned (launcher/node-stack.txt, mounted",
                "# here), wheels only (--only-binary :all:: no git clones, no source builds).",
                f'python3 -m uv pip sync --python "{VENV}/bin/python" --only-binary :all: '
                f"{LOCK_MOUNT}",
                f"# The project itself ({how}) and torchstore, whose",
                "# dependencies the lock already holds (a checkout is built: not a wheel).",
                f"{uv} {project}",
                f"{uv} --only-binary :all: {TORCHSTORE}",
                f'"{VENV}/bin/python" -c "import torch, monarch, torchtitan, torchstore; '
                "print('forgesky: torch', torch.__version__, 'cuda', torch.version.cuda)\"",
            ]
        )
        + "\n"
    )


# The tasks of a job group whose environment workers need CPU nodes beside the GPU nodes
# (launcher/task.py): SkyPilot names each node `<task>-<index>.<job group>` in /etc/hosts.
TRAIN_TASK = "train"
ENV_TASK = "envs"


def _addresses(task: str, count: int) -> list[str]:
    """Shell appending the addresses of `task`'s `count` nodes in the job group to IPS."""
    host = f"{task}-$i.$SKYPILOT_JOBGROUP_NAME"
    return [
        f"for i in $(seq 0 {count - 1}); do",
        f"  IP=$(getent hosts \"{host}\" | awk '{{print $1; exit}}' || true)",
        '  if [ -z "$IP" ]; then',
        f'    echo "forgesky: error: node {host} of the job group has no address" >&2; exit 1',
        "  fi",
        "  IPS=\"$IPS$IP\"$'\\n'",
        "done",
    ]


def joined_nodes(gpu_nodes: int, cpu_nodes: int, cpu_node: bool) -> list[str]:
    """Shell that makes one cluster of a job group's two tasks for `python -m runtime`: the GPU
    nodes first (ranks 0..), then the CPU nodes for the environments, in SKYPILOT_NODE_IPS and
    SKYPILOT_NODE_RANK as a one-task cluster has them (runtime/procs/cluster.py)."""
    lines = [
        f"# One cluster of the job group's {gpu_nodes} GPU node(s) ({TRAIN_TASK}) and {cpu_nodes}",
        f"# CPU node(s) for the environment workers ({ENV_TASK}), the GPU nodes first.",
        'IPS=""',
    ]
    if cpu_node:
        lines += [
            *_addresses(TRAIN_TASK, gpu_nodes),
            'export SKYPILOT_NODE_IPS="$IPS$SKYPILOT_NODE_IPS"',
            f"export SKYPILOT_NODE_RANK=$(( SKYPILOT_NODE_RANK + {gpu_nodes} ))",
        ]
    else:
        lines += [
            "IPS=\"$SKYPILOT_NODE_IPS\"$'\\n'",
            *_addresses(ENV_TASK, cpu_nodes),
            'export SKYPILOT_NODE_IPS="$IPS"',
        ]
    return lines


def run_script(
    *,
    recipe_name: str,
    recipe_ref: str,
    gated: bool,
    run_dir: str,
    overrides: Sequence[str] = (),
    code_path: str | None = None,
    env_nodes: tuple[int, int] | None = None,
    cpu_node_gpus: int | None = None,
) -> str:
    """Check the GPUs SkyPilot gave against MIN_GPUS, then start `python -m runtime`.

    recipe_ref is what `--recipe` gets on the node: a catalog name or a path there.
    overrides are `key=value` recipe overrides, passed on as `--set`. code_path is where the
    recipe's own code (losses, rewards) is mounted: it goes on PYTHONPATH. env_nodes: (GPU
    nodes, CPU nodes) of a job group whose CPU nodes host environment workers; the script of a
    CPU node (`cpu_node_gpus`: the run's GPUs, for its plan) skips the GPU check.
    """
    lines = [
        "set -euo pipefail",
        # The venv's bin first on PATH rather than `activate`, which is not written for set -u.
        f'export VIRTUAL_ENV="{VENV}" PATH="{VENV}/bin:$PATH"',
        "# An empty placeholder secret means not given: drop it so no library tries it.",
        'if [ -z "${HF_TOKEN:-}" ]; then unset HF_TOKEN; fi',
        'if [ -z "${WANDB_API_KEY:-}" ]; then unset WANDB_API_KEY; fi',
    ]
    if cpu_node_gpus is not None:
        lines += [
            "# A CPU node for the environment workers: the run's plan is for the GPU nodes' GPUs.",
            f"GPUS={cpu_node_gpus}",
        ]
    else:
        lines += [
            "# A cluster can come up smaller than the plan (`sky launch --gpus H100:2`, reused",
            "# clusters): stop before anything heavy starts.",
            "GPUS=$(( ${SKYPILOT_NUM_GPUS_PER_NODE:-0} * ${SKYPILOT_NUM_NODES:-1} ))",
            'if [ "$GPUS" -lt "$MIN_GPUS" ]; then',
            f'  echo "forgesky: error: recipe {recipe_name} needs at least $MIN_GPUS GPUs but this'
            " cluster has $GPUS (${SKYPILOT_NUM_NODES:-1} node(s) x"
            ' ${SKYPILOT_NUM_GPUS_PER_NODE:-0}); launch it with more" >&2',
            "  exit 2",
            "fi",
        ]
    if env_nodes is not None:
        lines += joined_nodes(*env_nodes, cpu_node=cpu_node_gpus is not None)
    if code_path:
        lines += [
            "# The recipe's own code (module:function losses and rewards), for every proc.",
            f'export PYTHONPATH="{code_path}${{PYTHONPATH:+:$PYTHONPATH}}"',
        ]
    if gated:
        lines += [
            'if [ -z "${HF_TOKEN:-}" ]; then',
            '  echo "forgesky: error: $MODEL is gated on the Hugging Face Hub; launch with'
            ' --secret HF_TOKEN (your token in the local environment)" >&2',
            "  exit 2",
            "fi",
        ]
    args = [
        "--recipe",
        shlex.quote(recipe_ref),
        "--gpus",
        '"$GPUS"',
        "--set",
        '"model.hf_id=$MODEL"',
        "--wandb",
        '"$WANDB_MODE"',
        "--run-dir",
        shlex.quote(run_dir),
    ]
    for item in overrides:
        args += ["--set", shlex.quote(item)]
    lines += [
        f"ARGS=({' '.join(args)})",
        'if [ -n "${MAX_STEPS:-}" ]; then ARGS+=(--steps "$MAX_STEPS"); fi',
        "# On SIGTERM (a preemption's shutdown, a cancel) the runtime checkpoints and exits 0, which",
        "# would end a managed job as a success: pass the signal on and report the stop as exit",
        f"# {STOPPED_EXIT_CODE}, which the job's recover_on_exit_codes restarts (and the run resumes).",
        'python -m runtime "${ARGS[@]}" &',
        "RUNTIME=$!",
        'STOPPED=""',
        """trap 'STOPPED=1; kill -TERM "$RUNTIME" 2>/dev/null || true' TERM""",
        'CODE=0; wait "$RUNTIME" || CODE=$?',
        "# wait returns early when the trap runs; the runtime's code then no longer matters.",
        'while kill -0 "$RUNTIME" 2>/dev/null; do wait "$RUNTIME" || true; done',
        f'if [ -n "$STOPPED" ]; then exit {STOPPED_EXIT_CODE}; fi',
        'exit "$CODE"',
    ]
    return "\n".join(lines) + "\n"
