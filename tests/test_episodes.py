"""Multi-turn episodes: tool calls in Qwen3's and Llama 3.1's formats, the episode loop against
a real environment (tiny-tools, hosted in this process), the training mask token by token and
the policy version of every token."""

import asyncio

import pytest

from runtime.environments.api import ToolCall
from runtime.environments.host import Spec
from runtime.environments.local import LocalEnvironments
from runtime.episodes.formats import tool_format
from runtime.episodes.loop import NOT_GENERATED, EpisodeRunner, Limits, Turn, episode_stats
from runtime.tasks.tiny_tools.environment import LOOKUP_TOOL, LookupEnvironment

TINY_TOOLS = Spec("runtime.tasks.tiny_tools.environment:LookupEnvironment")


def tiny_tools_environments():
    """The tiny-tools environment hosted in this process (the run's workers host the same)."""
    return LocalEnvironments(TINY_TOOLS)


# Qwen3's layout: tools as JSON in the system turn, calls in <tool_call> blocks, results as
# <tool_response> blocks in a user turn, an empty think block on the generation prompt.
QWEN3 = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)
# Llama 3.1's layout: tools in the system turn, a call is the assistant's whole turn as JSON
# with "parameters", results in ipython turns.
LLAMA31 = (
    "<|begin_of_text|>"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role in ('ipython', 'tool') %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = {
    "qwen3": ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
}
TEMPLATES = {"qwen3": QWEN3, "llama3": LLAMA31}
EOS = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}


def family_tokenizer(family):
    """One token per character, the family's markers one token each (built locally)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {s: i for i, s in enumerate(["<pad>", "<unk>", *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in ["<pad>", "<unk>"]])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIALS[family]])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token=EOS[family],
        chat_template=TEMPLATES[family],
    )


def pieces(tok, ids):
    return [tok.decode([i]) for i in ids]


class Scripted:
    """The model's side of an episode, written out: each call answers the next turn of every
    episode with the given text, sampled by `version` (log-prob -0.5 a token)."""

    def __init__(self, tok, turns, versions):
        self.tok, self.turns, self.versions = tok, list(turns), list(versions)
        self.calls = []

    async def __call__(self, prompts, most, seed):
        text, version = self.turns.pop(0), self.versions.pop(0)
        self.calls.append((len(prompts), most))
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        ids = ids[:most]
        ended = ids[-1:] == [self.tok.eos_token_id]
        return [
            Turn(list(ids), [-0.5] * len(ids), version, "stop" if ended else "length")
            for _ in prompts
        ]


CALLS = {
    "qwen3": '<tool_call>\n{"name": "lookup", "arguments": {"key": "c"}}\n</tool_call><|im_end|>',
    "llama3": '{"name": "lookup", "parameters": {"key": "c"}}<|eot_id|>',
}


def run(family, turns, versions, limits=None, rows=None):
    tok = family_tokenizer(family)
    envs = tiny_tools_environments()
    model = Scripted(tok, turns, versions)
    limits = limits or Limits(max_turns=4, max_tokens=400, max_turn_tokens=120)
    runner = EpisodeRunner(envs, tool_format(family, tok), model, limits)
    rows = rows or [{"question": "c"}]
    episodes = asyncio.run(runner.run(rows, [7] * len(rows)))
    return tok, envs, model, episodes


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_a_known_episode_trains_only_the_models_tokens_token_by_token(family):
    env = LookupEnvironment()
    env.reset(seed=7, row={"question": "c"})  # the episode's table (seed 7)
    value = env.table["c"]
    answer = f"{value}{EOS[family]}"
    tok, envs, model, (ep,) = run(family, [CALLS[family], answer], [3, 4])
    assert (ep.reward, ep.turns, ep.tool_calls, ep.tool_errors, ep.end) == (1.0, 2, 1, 0, "answer")

    # the whole sequence is the template's own rendering of the chat, token for token
    chat = [
        {"role": "user", "content": "c"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": {"key": "c"}}}
            ],
        },
        {"role": "ipython" if family == "llama3" else "tool", "content": value},
        {"role": "assistant", "content": value},
    ]
    fmt = tool_format(family, tok)
    rendered = tok.apply_chat_template(chat, tools=[LOOKUP_TOOL], tokenize=False)
    if family == "qwen3":  # each turn was sampled after the generation prompt's think block
        think = "<|im_start|>assistant\n"
        rendered = rendered.replace(think, think + "<think>\n\n</think>\n\n")
    whole = ep.prompt_ids + ep.tokens
    assert tok.decode(whole) == rendered[: len(tok.decode(whole))]
    assert rendered[len(tok.decode(whole)) :] in ("", "\n")  # the tail after the last turn

    # token by token: the model's two turns carry loss, the rest (prompt, tool result, the
    # template's markers between) none
    opening = fmt.prompt_ids([{"role": "user", "content": "c"}], [LOOKUP_TOOL])
    assert ep.prompt_ids == opening
    call_ids = tok(CALLS[family], add_special_tokens=False)["input_ids"]
    answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
    between = ep.tokens[len(call_ids) : len(ep.tokens) - len(answer_ids)]
    expected = (
        [(p, True) for p in pieces(tok, call_ids)]
        + [(p, False) for p in pieces(tok, between)]
        + [(p, True) for p in pieces(tok, answer_ids)]
    )
    assert list(zip(pieces(tok, ep.tokens), ep.generated, strict=True)) == expected
    if family == "qwen3":
        assert "".join(pieces(tok, between)) == (
            f"\n<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
    else:
        assert "".join(pieces(tok, between)) == (
            f"<|start_header_id|>ipython<|end_header_id|>\n\n{value}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    # log-probs only where the model sampled; each token the version of its turn
    assert ep.logprobs == [-0.5 if g else 0.0 for g in ep.generated]
    assert ep.versions == (
        [3] * len(call_ids) + [NOT_GENERATED] * len(between) + [4] * len(answer_ids)
    )
    assert ep.oldest_version == 3


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_turns_parse_into_calls_answers_or_malformed(family):
    fmt = tool_format(family, family_tokenizer(family))
    turn = fmt.parse(CALLS[family])
    assert turn.calls == (ToolCall("lookup", {"key": "c"}),) and turn.malformed is None
    assert fmt.parse(f"7{EOS[family]}").calls == ()
    assert fmt.parse(f"7{EOS[family]}").content == "7"
    bad = CALLS[family].replace('"key": "c"}', '"key": "c"')  # a brace short
    assert fmt.parse(bad).malformed and fmt.parse(bad).calls == ()
    if family == "qwen3":
        two = CALLS["qwen3"].replace("<|im_end|>", "") * 2
        assert len(fmt.parse(two).calls) == 2
        assert fmt.parse("<tool_call>\n{").malformed == "an unclosed <tool_call> block"
    else:
        two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": ";"}}'
        assert [c.name for c in fmt.parse(two).calls] == ["a", "b"]


def test_a_malformed_call_is_answered_with_an_error_and_counted_never_raised():
    bad = '<tool_call>\n{"name": "lookup", "arguments": {"key": }\n</tool_call><|im_end|>'
    tok, envs, model, (ep,) = run("qwen3", [bad, "<|im_end|>"], [0, 0])
    assert (ep.turns, ep.malformed, ep.tool_errors, ep.tool_calls) == (2, 1, 1, 0)
    text = tok.decode([t for t, g in zip(ep.tokens, ep.generated, strict=True) if not g])
    assert "error: malformed tool call" in text
    assert ep.reward == 0.0
    stats = episode_stats([ep])
    assert stats["episode/tool_errors"] == 1 and stats["episode/malformed_calls"] == 1


def test_an_unknown_tool_is_an_error_observation_from_the_environment():
    call = CALLS["qwen3"].replace("lookup", "search")
    tok, envs, model, (ep,) = run("qwen3", [call, "1<|im_end|>"], [0, 0])
    assert (ep.tool_calls, ep.tool_errors, ep.malformed) == (1, 1, 0)
    assert envs.counters()["tool_errors"] == 1
    assert "error: there is no tool 'search'; the tools are: lookup" in tok.decode(ep.tokens)


def test_max_turns_and_the_token_budget_end_episodes():
    _, _, model, (ep,) = run(
        "qwen3",
        [CALLS["qwen3"]] * 3,
        [0] * 3,
        Limits(max_turns=2, max_tokens=400, max_turn_tokens=120),
    )
    assert (ep.turns, ep.end, ep.tool_calls) == (2, "max_turns", 2)
    _, _, model, (ep,) = run(
        "qwen3",
        [CALLS["qwen3"]] * 3,
        [0] * 3,
        Limits(max_turns=9, max_tokens=60, max_turn_tokens=120),
    )
    assert ep.end == "max_tokens" and len(ep.tokens) <= 60
    assert model.calls[0] == (1, 60)  # the first turn may use the whole budget


def test_an_opening_prompt_keeps_its_last_max_prompt_tokens_tokens():
    limits = Limits(max_turns=1, max_tokens=400, max_turn_tokens=120)
    tok, _, _, (whole,) = run("qwen3", ["0<|im_end|>"], [0], limits)
    cut = Limits(max_turns=1, max_tokens=400, max_turn_tokens=120, max_prompt_tokens=20)
    _, _, _, (ep,) = run("qwen3", ["0<|im_end|>"], [0], cut)
    assert len(whole.prompt_ids) > 20 and ep.prompt_ids == whole.prompt_ids[-20:]


def test_episodes_share_each_generator_call_and_steps_run_per_episode():
    rows = [{"question": k} for k in "abc"]
    answer = "0<|im_end|>"
    _, envs, model, eps = run("qwen3", [CALLS["qwen3"], answer], [0, 1], rows=rows)
    assert [n for n, _ in model.calls] == [3, 3]  # one call per round, every episode in it
    assert [ep.tool_calls for ep in eps] == [1, 1, 1]
    assert episode_stats(eps)["episode/turns_mean"] == 2.0
    assert envs.counters()["tool_calls"] == 3


def test_limits_refuse_zero():
    with pytest.raises(ValueError, match="max_turns must be at least 1"):
        Limits(max_turns=0, max_tokens=10, max_turn_tokens=5)


def test_an_episode_group_trains_on_the_models_tokens_at_their_oldest_version():
    import torch

    from runtime.control.batching import collate_groups, spread, train_batch
    from runtime.control.buffer import RolloutBuffer
    from runtime.episodes.rollout import episode_group
    from runtime.tasks.data import Prompt

    rows = [{"question": "c"}] * 2
    tok, _, _, eps = run("qwen3", [CALLS["qwen3"], "1<|im_end|>"], [3, 5], rows=rows)
    group = episode_group(Prompt(0, "c", ""), eps)
    assert group.policy_version == 3  # the oldest turn's: the staleness rule counts from it
    assert group.token_versions[0] == eps[0].versions
    batch = collate_groups([group], pad_id=0)
    start = len(group.prompt_tokens)
    for row, ep in enumerate(eps):
        end = start + len(ep.tokens)
        assert batch.response_mask[row, start:end].tolist() == ep.generated
        assert (
            not batch.response_mask[row, :start].any() and not batch.response_mask[row, end:].any()
        )
        assert batch.old_logprobs[row, start:end].tolist() == ep.logprobs
    # the reference answers masked tokens only; spread lays them back over the response
    ref = [-1.0] * sum(eps[0].generated)
    assert spread(ref, eps[0].generated) == [-1.0 if g else 0.0 for g in eps[0].generated]
    train, info = train_batch(
        [group], pad_id=0, group_size=2, loss="grpo", version=4, mask_truncated=False
    )
    assert torch.equal(train["response_mask"], batch.response_mask)
    assert info["response/len_mean"] == sum(eps[0].generated)
    assert info["policy/staleness_mean"] == 1.0
    # a trainer 2 versions past the oldest turn drops it with max_policy_age 1
    buffer = RolloutBuffer(max_policy_age=1, capacity=4)
    assert buffer.is_fresh(group, 4) and not buffer.is_fresh(group, 5)


def test_a_group_with_a_lost_episode_carries_no_rewards():
    from runtime.episodes.rollout import episode_group
    from runtime.tasks.data import Prompt

    class Losing:
        """tiny-tools whose second episode's worker is lost before it closes."""

        def __init__(self):
            self.inner, self.opened = tiny_tools_environments(), []

        async def open(self, row, seed):
            opening = await self.inner.open(row, seed)
            self.opened.append(opening.episode)
            return opening

        async def step(self, episode, call):
            return await self.inner.step(episode, call)

        async def close(self, episode, answer):
            reward = await self.inner.close(episode, answer)
            return None if episode == self.opened[1] else reward

        def counters(self):
            return self.inner.counters()

    tok = family_tokenizer("qwen3")
    model = Scripted(tok, ["1<|im_end|>"], [0])
    limits = Limits(max_turns=2, max_tokens=100, max_turn_tokens=50)
    runner = EpisodeRunner(Losing(), tool_format("qwen3", tok), model, limits)
    eps = asyncio.run(runner.run([{"question": "a"}] * 2, [1, 1]))
    assert [ep.dropped for ep in eps] == [False, True]
    assert episode_stats(eps)["episode/dropped"] == 1
    assert episode_group(Prompt(0, "a", ""), eps).rewards == []
    # a step in which no call ended: counts 0 (a chart without gaps), no mean
    none = episode_stats([])
    assert none["episode/dropped"] == 0 and none["episode/tool_calls"] == 0
    assert "episode/turns_mean" not in none


def test_the_tiny_tools_tokenizer_fits_its_architecture_and_renders_calls_as_one_token():
    from recipes.architectures import architecture
    from runtime.tasks.tiny_tools import tokenizer
    from runtime.tasks.tiny_tools.tokenization import call_text

    tok = tokenizer()
    assert len(tok) == architecture("qwen3", "tiny-tools").vocab_size
    assert len(tok(call_text("b"), add_special_tokens=False)["input_ids"]) == 1
    fmt = tool_format("qwen3", tok)
    assert fmt.parse(call_text("b") + "<|im_end|>").calls == (ToolCall("lookup", {"key": "b"}),)


@pytest.mark.slow
def test_tiny_tools_learns_to_call_its_tool_and_copy_the_result():
    """The tiny-tools recipe's promise with its settings, the trainer and generator in this
    process and the environment in the recipe's worker processes: from random weights, reward
    from near 0 to >= 0.8, two turns an episode (the call, then the answer)."""
    import dataclasses
    import random
    import statistics
    import time

    import torch

    from recipes import load_recipe
    from runtime.backends import HFGenerator, OptimizerConfig, TitanTrainer
    from runtime.control.batching import train_batch
    from runtime.episodes.rollout import EpisodeRollout
    from runtime.grpo import group_advantages, policy_loss
    from runtime.models import ModelSpec
    from runtime.tasks.data import Prompt
    from runtime.tasks.tiny_tools import KEYS, tokenizer

    recipe = load_recipe("recipes/catalog/tiny-tools.yaml")
    g = recipe.grpo
    tok = tokenizer()
    spec = dataclasses.replace(ModelSpec.from_arch(recipe.arch), vocab_size=len(tok))
    rewards, turns, seconds = [], [], {"step": 0.0, "env_wait": 0.0, "idle": 0.0}

    async def learn():
        trainer = TitanTrainer(spec, OptimizerConfig(lr=g.learning_rate), seed=0)
        gen = HFGenerator(
            spec, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0,
            weights=trainer.hf_state_dict(),
        )  # fmt: skip
        episodes = await EpisodeRollout.start(recipe, tok)
        assert episodes.environments.pids and None not in episodes.environments.pids

        async def turn(prompts, most, seed):
            out = gen.generate(prompts, n=1, max_new_tokens=most, temperature=1.0, seed=seed)
            return [vars(c) for c in out]

        rng = random.Random(0)
        try:
            for step in range(g.steps):
                start = time.perf_counter()
                prompts = [Prompt(i, rng.choice(KEYS), "") for i in range(g.prompts_per_step)]
                groups = await episodes.groups(prompts, rng.randrange(1 << 30), turn)
                stats = episodes.take_stats()
                train, info = train_batch(
                    groups, pad_id=tok.pad_token_id, group_size=g.group_size, loss="grpo",
                    version=step,
                )  # fmt: skip
                trainer.train_step(
                    train["tokens"], train["response_mask"],
                    group_advantages(torch.tensor([r for gr in groups for r in gr.rewards]),
                                     g.group_size),
                    train["old_logprobs"], None, policy_loss,
                    max_response_tokens=g.max_response_tokens, variant=g.loss,
                    clip_high=g.clip_high, entropy_coef=g.entropy_coef,
                )  # fmt: skip
                gen.load_weights(trainer.hf_state_dict())
                gen.policy_version = step + 1
                rewards.append(info["reward/mean"])
                turns.append(stats["episode/turns_mean"])
                assert stats["episode/dropped"] == 0 and stats["episode/workers_lost"] == 0
                seconds["step"] += time.perf_counter() - start
                seconds["env_wait"] += stats["episode/env_wait_s"]
                seconds["idle"] += stats["episode/generator_idle_s"]
        finally:
            await episodes.shutdown()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        asyncio.run(learn())
    finally:
        torch.set_num_threads(threads)
    print(
        f"tiny-tools: reward {statistics.mean(rewards[:5]):.2f} (first 5 steps) -> "
        f"{statistics.mean(rewards[-10:]):.2f} (last 10), turns {statistics.mean(turns[-10:]):.2f}; "
        f"{seconds['step']:.0f} s of steps, {seconds['env_wait']:.0f} s waiting on the "
        f"environment workers, generator idle {seconds['idle']:.0f} s"
    )
    assert statistics.mean(rewards[:5]) < 0.1, rewards[:5]
    assert statistics.mean(rewards[-10:]) >= 0.8, rewards[-10:]
    assert statistics.mean(turns[-10:]) >= 1.95, turns[-10:]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("env.max_turns=0", "env.max_turns: Input should be greater than 0"),
        ("env.max_turn_tokens=0", "env.max_turn_tokens: Input should be greater than 0"),
        (
            "env.max_turn_tokens=41",
            "env.max_turn_tokens: 41 exceeds the episode's grpo.max_response_tokens 40",
        ),
        ("env.name=builtin:tiny", "env.name: no shipped environment named 'tiny'"),
        (
            "eval={enabled: true, reward: math}",
            "eval.reward: 'math': a recipe with env is evaluated by its environment's reward",
        ),
        ("env=null", "dataset.rewards: List should have at least 1 item"),
    ],
)
def test_a_bad_env_section_is_one_line(override, message):
    from recipes import UserError, apply_overrides, load_recipe

    recipe = load_recipe("recipes/catalog/tiny-tools.yaml")
    with pytest.raises(UserError) as info:
        apply_overrides(recipe, [override])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_spans_count_overlapping_calls_once():
    """A replica's lanes open episode calls that overlap: the idle metrics take the seconds in
    which at least one was open, a call still open counted up to the record and carried on."""
    from runtime.episodes import rollout

    now = [0.0]
    spans = rollout.Spans(clock=lambda: now[0])
    with spans.span():  # 0 -> 10
        now[0] = 2.0
        with spans.span():  # 2 -> 5, inside the first
            now[0] = 5.0
        now[0] = 10.0
    now[0] = 12.0
    second = spans.span()
    second.__enter__()  # 12 -> (still open at the record, 15) -> 20
    assert spans.take(15.0) == 10.0 + 3.0
    now[0] = 20.0
    second.__exit__(None, None, None)
    assert spans.take(21.0) == 5.0
    assert spans.take(22.0) == 0.0
