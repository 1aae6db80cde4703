"""One run: start the weight store and every service from the plan, train, shut down cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import time

from runtime.control.checkpoint import approx_size
from runtime.control.config import RunConfig
from runtime.control.startup import start_services
from runtime.procs.lifecycle import RunLifecycle


async def _main(life: RunLifecycle, config: RunConfig) -> None:
    from runtime.control.controller import Controller
    from runtime.control.metrics import MetricsLogger

    recipe = config.recipe
    print(config.plan.describe(), flush=True)
    start = time.perf_counter()
    services = ["weight store", "trainer", "generator"]
    services += ["reference"] if config.plan.reference_enabled else []
    print(f"starting services ({', '.join([*services, 'reward'])}) ...", flush=True)
    services = await start_services(life, config)
    print(
        f"services ready in {time.perf_counter() - start:.1f} s; run dir {config.run_dir}",
        flush=True,
    )
    controller = Controller(config, services, life.stopping)
    await controller.prepare()
    recorded = {**recipe.model_dump(mode="json"), "plan": config.plan.to_dict()}
    (config.run_dir / "config.json").write_text(json.dumps(recorded, indent=2) + "\n")
    metrics = MetricsLogger(
        config.run_dir,
        wandb_mode=config.wandb_mode,
        run_name=config.run_dir.name,
        config=recorded,
        resume_id=controller.wandb_run_id,
        total_steps=recipe.grpo.steps,
    )
    controller.metrics = metrics

    async def close_metrics() -> None:
        metrics.close()

    life.register("metrics", close_metrics)
    controller.start_rollouts()
    await controller.train()
    await controller.stop_rollouts()
    if controller.step > (controller.resumed_from or 0) or life.stopping.is_set():
        await controller.save_checkpoint()
    finished = controller.step >= recipe.grpo.steps
    if finished:
        model = config.run_dir / "model"
        provenance = {
            "recipe": recipe.name,
            "step": controller.step,
            "run_dir": str(config.run_dir),
        }
        width = 2 if recipe.model.dtype == "bfloat16" else 4
        size = approx_size(width * recipe.arch.params)
        print(f"writing the model ({size} of {recipe.model.dtype} safetensors) ...", flush=True)
        await controller.services.export(str(model), provenance)
        print(f"model -> {model} (Hugging Face format: transformers, vLLM)", flush=True)
    status = "finished" if finished else "stopped"
    print(f"{status} at step {controller.step}; outputs in {config.run_dir}", flush=True)


def run(config: RunConfig) -> int:
    """Run to the end, a stop or a failure; the process exit code."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    life = RunLifecycle("forgesky")
    return asyncio.run(life.run(lambda lf: _main(lf, config)))
