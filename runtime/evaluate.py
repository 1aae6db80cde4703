"""`forgesky eval SOURCE`: a finished model evaluated the way a run evaluates it.

SOURCE is a run directory (its newest committed checkpoint, and the recipe it recorded in
config.json), one checkpoint directory of it (`RUN_DIR/checkpoints/step_000060`), a Hugging
Face model folder (config.json and *.safetensors) or a LoRA adapter folder in PEFT's format
(adapter_config.json and adapter_model.safetensors): one a run or `forgesky export` wrote records
its recipe and step in forgesky.json, any other needs `--recipe` (the recipe whose held-out
data, rewards and sampling apply). An adapter, from a folder or a LoRA run's checkpoint, is
merged into the recipe's base in memory and the merged model evaluated. The recipe's `eval` section says what is evaluated (it need
not be enabled for training): the same prompts, the same greedy pass@1 and sampled pass@k, the
same rewards as the evaluations during the run, here in one process with the recipe's generator
backend (vLLM on a GPU, the HF generator on a CPU recipe).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from recipes import UserError
from runtime.eval_weights import load_hf_weights
from runtime.sources import Source, exported_step, full_model, resolve_recipe, resolve_source


def held_out_prompts(recipe: Any) -> list[Any]:
    """The prompts the recipe's eval section names, in the data's order."""
    from runtime.tasks.data import build_prompt_source

    e = recipe.eval
    source = build_prompt_source(recipe.dataset, split=e.split, path=e.path, shuffle=False)
    return source.take(min(e.prompts, len(source)))


def evaluate(
    recipe: Any, prompts: list[Any], weights: dict[str, Any], *, log=print
) -> dict[str, float]:
    """Greedy and sampled completions of `prompts`, scored by the recipe's rewards."""
    from recipes import apply_overrides, dedicated_gpus, plan
    from runtime.backends import build
    from runtime.control.evaluation import (
        episode_figures,
        judge,
        judge_episodes,
        needs_samples,
        score_items,
        summarize,
    )
    from runtime.tasks.rewards import build_reward_fn

    e, g = recipe.eval, recipe.grpo
    # the weights are a whole model (an adapter merged already): no LoRA in the generator
    recipe = full_model(recipe)
    # the generator's settings with a GPU of its own: it runs alone here
    alone = apply_overrides(recipe, ["layout.share=none"])
    settings = plan(alone, dedicated_gpus(alone)).settings
    tokenizer = build.load_tokenizer(recipe)
    start = time.perf_counter()
    generator = build.GeneratorConfig(recipe, settings.generator).build(tokenizer)
    try:
        generator.load_weights(weights)
        log(f"generator ready ({type(generator).__name__}) in {time.perf_counter() - start:.1f} s")
        thinking = recipe.model.thinking
        ids = [
            build.encode_messages(tokenizer, p.messages(), g.max_prompt_tokens, thinking)
            for p in prompts
        ]

        if recipe.env is not None:
            start = time.perf_counter()
            greedy, sampled = play_episodes(recipe, prompts, generator, tokenizer)
            metrics = summarize(judge_episodes(greedy, sampled, e), e)
            metrics |= episode_figures(greedy, sampled)
            metrics["eval/seconds"] = time.perf_counter() - start
            return metrics

        def texts(n: int, temperature: float) -> list[str]:
            out = generator.generate(
                ids,
                n=n,
                max_new_tokens=g.max_response_tokens,
                temperature=temperature,
                top_p=g.top_p,
                seed=g.seed,
                logprobs=False,
            )
            return [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in out]

        start = time.perf_counter()
        greedy = texts(1, 0.0)
        sampled = texts(e.samples_drawn, g.temperature) if needs_samples(e) else []
    finally:
        close = getattr(generator, "close", None)
        if close is not None:
            close()
    reward = e.reward or recipe.dataset.rewards[0].name
    mix = build_reward_fn(recipe.dataset.rewards)
    scores = [mix(*item) for item in score_items(prompts, greedy, sampled)]
    metrics = summarize(judge(scores, len(prompts), e, reward), e)
    metrics["eval/seconds"] = time.perf_counter() - start
    return metrics


def play_episodes(
    recipe: Any, prompts: list[Any], generator: Any, tokenizer: Any
) -> tuple[list[Any], list[Any]]:
    """The held-out prompts played as episodes in the recipe's environment (the run's
    evaluation, runtime/control/evaluation.py): one greedy a prompt, then `eval.samples` at the
    run's temperature where pass@k asks for them; (greedy, sampled) episodes."""
    import asyncio

    from runtime.control.evaluation import episode_seeds, needs_samples
    from runtime.environments.workers import EnvironmentsLost
    from runtime.episodes.rollout import EpisodeRollout

    e, g = recipe.eval, recipe.grpo

    def at(temperature: float) -> Any:
        async def turn(ids: list[list[int]], most: int, seed: int) -> list[dict[str, Any]]:
            out = generator.generate(
                ids,
                n=1,
                max_new_tokens=most,
                temperature=temperature,
                top_p=g.top_p,
                seed=seed,
                logprobs=False,
            )
            return [vars(c) for c in out]

        return turn

    async def both() -> tuple[list[Any], list[Any]]:
        seeds = episode_seeds(prompts, g.seed)
        # the environment's workers, as a run starts them
        rollout = await EpisodeRollout.start(recipe, tokenizer)
        try:
            greedy = await rollout.play(prompts, seeds, 1, at(0.0))
            sampled = []
            if needs_samples(e):
                sampled = await rollout.play(prompts, seeds, e.samples_drawn, at(g.temperature))
            return greedy, sampled
        finally:
            await rollout.shutdown()

    try:
        return asyncio.run(both())
    except EnvironmentsLost as lost:
        # workers that cannot start (the environment, its env.args) or all died: one line
        raise UserError(f"eval: {lost}") from None


def _is_eval_result(path: Path) -> bool:
    """Whether `path` holds what `run` writes with --out (its keys below)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"source", "recipe", "eval/prompts"} <= set(data)


def check_out_file(out: str) -> None:
    """--out FILE: a new file in a folder that exists, or the metrics an earlier eval wrote
    there (evaluating again replaces them); any other file, a recipe say, is not replaced."""
    path = Path(out)
    if not out.strip():
        raise UserError("eval: --out is blank; name a new file for the metrics (JSON)")
    if path.is_dir():
        raise UserError(f"eval: --out {out} is a folder; name a file for the metrics (JSON)")
    if path.exists() and not _is_eval_result(path):
        raise UserError(
            f"eval: --out {out} exists and is not metrics an eval wrote; name a new file "
            "(nothing is overwritten)"
        )
    if not path.parent.is_dir():
        raise UserError(f"eval: --out {out}: the folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"eval: --out {out}: the folder {path.parent} is not writable")


def _run_sft(source: Source, recipe: Any, out: str | None) -> int:
    """An SFT model's evaluation: its held-out loss (runtime.sft.run.evaluate) and, where the
    recipe names a reward (eval.reward), pass@1 and pass@k of sampled completions
    (runtime.sft.sampled)."""
    from runtime.sft.run import evaluate as held_out_loss

    e, step = recipe.eval, exported_step(source)
    data = e.path or recipe.dataset.path
    sampled = f"; pass@k by {e.reward} on up to {e.prompts} of them" if e.reward else ""
    print(
        f"evaluating {source.path} with recipe {recipe.name}: the loss on up to {e.rows} rows "
        f"of {data} {e.split}{sampled}",
        flush=True,
    )
    if e.reward:
        from runtime.tasks.rewards import resolve_reward

        resolve_reward(e.reward)  # a reward that cannot be imported: said before any work
    weights = load_hf_weights(source, recipe)
    metrics = held_out_loss(recipe, weights)
    print(
        f"loss {metrics['eval/loss']:.4g} ({int(metrics['eval/rows'])} rows, "
        f"{int(metrics['eval/tokens'])} assistant tokens, {metrics['eval/seconds']:.1f} s)"
    )
    if e.reward:
        from runtime.sft.sampled import evaluate as pass_at_k

        metrics |= pass_at_k(recipe, weights)
    if out:
        result = {"source": str(source.path), "step": step, "recipe": recipe.name, "data": data}
        Path(out).write_text(json.dumps({**result, "split": e.split, **metrics}, indent=2) + "\n")
    return 0


def run(source_text: str, recipe_name: str | None, overrides: list[str], out: str | None) -> int:
    """Evaluate SOURCE, print the metrics (and write them to `out`); UserError for mistakes."""
    if out is not None:
        check_out_file(out)  # before the evaluation, not after it
    source = resolve_source(source_text)
    recipe = resolve_recipe(source, recipe_name, overrides)
    if recipe.kind == "sft":
        return _run_sft(source, recipe, out)
    e = recipe.eval
    step = exported_step(source)
    if source.kind in ("hf", "adapter"):
        what = f"{source.path}" + (f" (step {step})" if step is not None else "")
    else:
        what = f"step {step} of {source.path.parent.parent}" if step else source.path
    data = e.path or recipe.dataset.path
    samples = f" and {e.samples_drawn} samples" if e.samples_drawn > 1 or e.k > 1 else ""
    played = f" as episodes in {recipe.env.name}" if recipe.env is not None else ""
    print(
        f"evaluating {what} with recipe {recipe.name}: up to {e.prompts} prompts of {data} "
        f"{e.split}{played}, greedy{samples} each",
        flush=True,
    )
    prompts = held_out_prompts(recipe)
    weights = load_hf_weights(source, recipe)
    metrics = evaluate(recipe, prompts, weights, log=lambda line: print(line, flush=True))
    shown = ", ".join(
        f"{k.removeprefix('eval/')} {v:.3g}"
        for k, v in metrics.items()
        if k not in ("eval/prompts", "eval/seconds")
    )
    print(f"{shown} ({int(metrics['eval/prompts'])} prompts, {metrics['eval/seconds']:.1f} s)")
    if out:
        result = {
            "source": str(source.path),
            "step": step,
            "recipe": recipe.name,
            "data": data,
            "split": e.split,
            **metrics,
        }
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
