"""Evaluation over episodes: the held-out prompts of a recipe with an `env` section played as
episodes in its environment (tiny-tools, in-process), during a run (runtime/control/evaluation.py)
and by `forgesky eval` (runtime/evaluate.py); pass@1 and pass@k from the environment's rewards,
and what the episodes did (turns, tool calls, failed calls)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import save_file

from launcher.cli import main
from recipes import UserError, apply_overrides, load_recipe
from runtime.control.evaluation import Evaluator
from runtime.control.progress import Progress
from runtime.control.turns import GpuTurns
from runtime.episodes.rollout import EpisodeRollout
from runtime.evaluate import held_out_prompts
from runtime.tasks.tiny_tools import tokenizer
from runtime.tasks.tiny_tools.tokenization import call_text

EVAL = ["eval.enabled=true", "eval.k=2", "eval.samples=4"]


class Policy:
    """The model's side, written out on the tiny-tools tokenizer. Greedy: `greedy_calls` lookups
    of the prompt's key (the second gets the environment's error), then the digit the tool
    returned; sampled: the answer "0" at once, without the tool."""

    def __init__(self, greedy_calls: int = 1) -> None:
        self.tok = tokenizer()
        self.greedy_calls = greedy_calls
        self.temperatures: list[float | None] = []

    def turn(self, ids: list[int], temperature: float | None) -> str:
        text = self.tok.decode(ids, skip_special_tokens=False)
        if temperature:
            return "0"
        key = text.split("user\n", 1)[1][0]
        if text.count("<tool_response>") < self.greedy_calls:
            return call_text(key)
        return text.rsplit("<tool_response>\n", 1)[1][0]

    async def continue_tokens(self, replica, prompts, seed, max_new_tokens, temperature=None):
        self.temperatures.append(temperature)
        out = []
        for ids in prompts:
            turn = self.tok(self.turn(ids, temperature), add_special_tokens=False)["input_ids"]
            turn = turn[:max_new_tokens]
            out.append(
                {
                    "response_ids": turn,
                    "response_logprobs": [-0.1] * len(turn),
                    "policy_version": 3,
                    "finish_reason": "length",
                }
            )
        return out


class Services:
    """What the evaluator asks of the run's services: the generator's turns (the policy)."""

    generators = 1

    def __init__(self, policy: Policy) -> None:
        self.continue_tokens = policy.continue_tokens

    def fail(self, error: BaseException) -> None:
        raise error


def evaluate_in_run(policy: Policy, overrides: list[str] = EVAL) -> dict[str, float]:
    recipe = apply_overrides(load_recipe("tiny-tools"), overrides)

    async def evaluate() -> dict[str, float]:
        episodes = await EpisodeRollout.start(recipe, tokenizer(), in_process=True)
        evaluator = Evaluator(
            recipe,
            Services(policy),
            Progress(1),
            GpuTurns([]),
            prompts=held_out_prompts(recipe),
            episodes=episodes,
        )
        try:
            metrics = await evaluator.run(0)
        finally:
            await episodes.shutdown()
        # an evaluation's episodes are not the training's: nothing joins the rollout's figures
        figures = episodes.take_stats()
        assert "episode/turns_mean" not in figures and figures["episode/env_wait_s"] == 0
        return metrics

    return asyncio.run(evaluate())


def test_a_run_evaluates_episodes_greedy_pass_at_1_and_sampled_pass_at_k():
    policy = Policy(greedy_calls=1)
    metrics = evaluate_in_run(policy)
    # every greedy episode looked its key up and copied the digit: right, two turns, one call
    assert metrics["eval/prompts"] == 3
    assert metrics["eval/pass@1"] == 1.0 and metrics["eval/reward_mean"] == 1.0
    assert metrics["eval/turns_mean"] == 2.0
    assert metrics["eval/tool_calls_mean"] == 1.0 and metrics["eval/tool_errors_mean"] == 0.0
    # the samples answered without the tool: an unlooked-up answer never scores 1.0
    assert metrics["eval/mean@4"] == 0.0 and metrics["eval/pass@2"] == 0.0
    assert metrics["eval/dropped"] == 0.0 and metrics["eval/version"] == 3.0
    # greedy turns (two rounds), then sampled ones (one round) at the run's temperature
    assert policy.temperatures == [0.0, 0.0, 1.0]


def test_an_episode_that_calls_twice_is_counted_with_its_error_and_scores_nothing():
    metrics = evaluate_in_run(Policy(greedy_calls=2), ["eval.enabled=true"])
    assert metrics["eval/pass@1"] == 0.0 and metrics["eval/reward_mean"] == 0.0
    # two calls an episode (its two turns), the second refused: one lookup an episode
    assert metrics["eval/tool_calls_mean"] == 2.0 and metrics["eval/tool_errors_mean"] == 1.0
    assert metrics["eval/turns_mean"] == 2.0
    assert "eval/mean@1" not in metrics and "eval/pass@2" not in metrics


def test_an_env_recipe_evaluates_by_its_environments_reward_not_a_dataset_reward():
    recipe = apply_overrides(load_recipe("tiny-tools"), ["eval.enabled=true"])
    assert recipe.eval.enabled
    with pytest.raises(UserError) as info:
        apply_overrides(recipe, ["eval.reward=math"])
    assert "eval.reward: 'math': a recipe with env is evaluated by its environment's reward" in (
        str(info.value)
    )


def calling_model(folder) -> None:
    """A tiny-tools model folder whose greedy policy calls lookup("a") after every newline:
    its blocks add nothing to the residual stream (attention and MLP outputs zero), so the
    next token is decided by the last one alone, through the tied embeddings."""
    from runtime.backends import build
    from runtime.models import build_model, hf_config
    from runtime.models.hf import to_hf

    recipe = load_recipe("tiny-tools")
    spec = build.model_spec(recipe)
    weights = to_hf(build_model(spec, "cpu").state_dict(), spec)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    tok = tokenizer()
    embed = weights["model.embed_tokens.weight"]
    newline, call = tok.convert_tokens_to_ids("\n"), tok.convert_tokens_to_ids(call_text("a"))
    direction = torch.zeros(spec.dim)
    direction[0] = 1.0
    embed[newline] = direction
    embed[call] = 8.0 * direction
    hf_config(spec).save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")


def test_forgesky_eval_plays_episodes_and_counts_the_tool_calls(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    calling_model(folder)
    out_file = tmp_path / "eval.json"
    args = [str(folder), "--recipe", "tiny-tools", "--out", str(out_file)]
    assert main(["eval", *args, "--set", "eval.k=2", "--set", "eval.samples=4"]) == 0
    out = capsys.readouterr().out
    assert "up to 256 prompts of builtin:tiny-tools test as episodes in builtin:tiny-tools" in out
    result = json.loads(out_file.read_text())
    # three keys, each episode: lookup("a"), then lookup("a") again (refused: one lookup an
    # episode) in its last turn: two turns, two calls, one error, no answer, no reward
    assert result["eval/prompts"] == 3
    assert result["eval/turns_mean"] == 2.0
    assert result["eval/tool_calls_mean"] == 2.0 and result["eval/tool_errors_mean"] == 1.0
    assert result["eval/pass@1"] == 0.0 and result["eval/reward_mean"] == 0.0
    assert {"eval/mean@4", "eval/pass@2", "eval/dropped"} <= set(result)


@pytest.mark.slow
def test_forgesky_eval_whose_environment_cannot_start_is_one_line(tmp_path, capsys):
    """The environment's workers each fail to build it (its env.args): three tries a worker,
    then one line and exit code 2."""
    folder = tmp_path / "model"
    folder.mkdir()
    calling_model(folder)
    sets = ["env.name=bench.tools_env:WaitEnvironment", "env.args={tool_s: -1}"]
    args = [str(folder), "--recipe", "tiny-tools", "--set", "env.workers_per_node=1"]
    assert main(["eval", *args, *(f"--set={s}" for s in sets)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "forgesky: error: eval: environment actor failed" in err
    assert "raised ValueError: tool_s must be 0 or more, got -1" in err
