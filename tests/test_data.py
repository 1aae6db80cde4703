"""Prompt sources: formatting, seeded per-epoch order, resume, and loading user data from disk."""

import json
import os
import subprocess
import sys

import datasets
import pytest

from recipes.errors import UserError
from recipes.run_sections import Dataset as DatasetSpec
from runtime.tasks.data import (
    HFPromptSource,
    Prompt,
    PromptSource,
    build_prompt_source,
)

ROWS = [
    {"question": f"Tom has {i} apples and buys 2 more. How many?", "answer": f"...\n#### {i + 2}"}
    for i in range(10)
]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def spec(path, **kw):
    return DatasetSpec(path=path, rewards=[{"name": "math"}], **kw)


# ---------------------------------------------------------------- formatting


def test_prompt_applies_template_and_system_prompt():
    source = PromptSource(
        ROWS, prompt_template="Q: {question}\nA:", system_prompt="Be brief.", shuffle=False
    )
    first = next(source)
    assert first == Prompt(
        0, "Q: Tom has 0 apples and buys 2 more. How many?\nA:", "...\n#### 2", "Be brief."
    )
    assert first.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": first.text},
    ]
    assert Prompt(1, "hi", "x").messages() == [{"role": "user", "content": "hi"}]


def test_non_string_answers_become_strings():
    source = PromptSource(
        [{"q": "2+2?", "a": 4}, {"q": "none?", "a": None}],
        prompt_field="q",
        answer_field="a",
        shuffle=False,
    )
    assert [p.answer for p in source.take(2)] == ["4", ""]


@pytest.mark.parametrize("field", ["prompt_field", "answer_field"])
def test_unknown_field_names_the_field_and_the_columns(field):
    with pytest.raises(UserError) as info:
        PromptSource(ROWS, **{field: "problem"}, name="gsm8k")
    assert str(info.value) == (
        f"dataset 'gsm8k': dataset.{field} 'problem' is not a column; columns: question, answer"
    )


def test_bad_template_is_a_user_error():
    with pytest.raises(UserError, match=r"unknown placeholder \{problem\}"):
        PromptSource(ROWS, prompt_template="{problem}")
    with pytest.raises(UserError, match="not a format string"):
        PromptSource(ROWS, prompt_template="{question")


def test_empty_dataset_is_a_user_error():
    with pytest.raises(UserError, match="has no rows"):
        PromptSource([], name="empty")


# ---------------------------------------------------------------- order and resume


def ids(prompts):
    return [p.id for p in prompts]


def test_each_epoch_visits_every_row_once_in_a_new_order():
    source = PromptSource(ROWS, seed=3)
    epochs = [ids(source.take(len(ROWS))) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(10))
    assert len({tuple(order) for order in epochs}) == 3
    assert source.state_dict() == {"epoch": 3, "index": 0, "seed": 3, "num_prompts": 10}


def test_order_depends_only_on_seed():
    assert ids(PromptSource(ROWS, seed=1).take(25)) == ids(PromptSource(ROWS, seed=1).take(25))
    assert ids(PromptSource(ROWS, seed=1).take(10)) != ids(PromptSource(ROWS, seed=2).take(10))
    assert ids(PromptSource(ROWS, shuffle=False).take(12)) == [*range(10), 0, 1]


def test_order_is_the_same_in_another_interpreter():
    # The resumed run is a new process (maybe another hash seed): the order must not move.
    code = "from runtime.tasks.data import PromptSource; print([p.id for p in PromptSource([{'question': 'q', 'answer': 'a'}] * 10, seed=5).take(10)])"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": hs},
        ).stdout
        for hs in ("1", "2")
    }
    assert len(outs) == 1
    assert json.loads(outs.pop()) == ids(PromptSource(ROWS, seed=5).take(10))


def test_resume_continues_exactly_where_the_run_stopped():
    uninterrupted = ids(PromptSource(ROWS, seed=7).take(27))
    first = PromptSource(ROWS, seed=7)
    head = ids(first.take(13))
    state = json.loads(json.dumps(first.state_dict()))  # it travels in a checkpoint
    resumed = PromptSource(ROWS, seed=0)  # the saved seed wins
    resumed.load_state_dict(state)
    assert head + ids(resumed.take(14)) == uninterrupted


def test_resume_with_a_different_dataset_is_a_user_error():
    state = PromptSource(ROWS).state_dict()
    with pytest.raises(UserError, match="has 5 prompts but the checkpoint was taken with 10"):
        PromptSource(ROWS[:5], name="mine").load_state_dict(state)


# ---------------------------------------------------------------- loading from disk


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_local_jsonl_file(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    source = HFPromptSource(str(path), prompt_template="{question}", shuffle=False)
    assert len(source) == 10
    assert next(source) == Prompt(0, ROWS[0]["question"], ROWS[0]["answer"])


def test_local_json_and_csv_files_with_a_custom_split_name(tmp_path):
    (tmp_path / "mine.json").write_text(json.dumps(ROWS))
    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "mine.csv"))
    for name in ("mine.json", "mine.csv"):
        source = HFPromptSource(str(tmp_path / name), split="test", shuffle=False)
        assert ids(source.take(3)) == [0, 1, 2]
        assert source.prompt(4).answer == ROWS[4]["answer"]


def test_saved_dataset_and_dataset_dict(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:3])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(HFPromptSource(str(tmp_path / "ds"))) == 10
    assert len(HFPromptSource(str(tmp_path / "dd"), split="test")) == 3
    with pytest.raises(UserError, match="no split 'validation'; splits: train, test"):
        HFPromptSource(str(tmp_path / "dd"), split="validation")


def test_directory_of_data_files_goes_through_load_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "train.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "d" / "test.jsonl", ROWS[4:])
    assert len(HFPromptSource(str(tmp_path / "d"), split="test")) == 6
    with pytest.raises(UserError, match='Unknown split "dev"'):
        HFPromptSource(str(tmp_path / "d"), split="dev")


def test_bad_local_paths_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        HFPromptSource(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="no such file or directory"):
        HFPromptSource("data/missing.jsonl")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="unsupported file type"):
        HFPromptSource(str(tmp_path / "notes.txt"))


def test_unreachable_hub_dataset_is_a_user_error(tmp_path):
    code = (
        "from runtime.tasks.data import load_hf_dataset\n"
        "from recipes.errors import UserError\n"
        "try:\n"
        "    load_hf_dataset('forgesky-test/no-such-dataset')\n"
        "except UserError as e:\n"
        "    print(e)\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("dataset 'forgesky-test/no-such-dataset': ")
    assert "\n" not in line


# ---------------------------------------------------------------- from a recipe


def test_build_prompt_source_from_recipe_dataset_section(tmp_path):
    path = write_jsonl(
        tmp_path / "gsm.jsonl", [{"q": r["question"], "a": r["answer"]} for r in ROWS]
    )
    section = spec(
        str(path),
        prompt_field="q",
        answer_field="a",
        prompt_template="Solve: {question}",
        system_prompt="You are careful.",
    )
    source = build_prompt_source(section, seed=4)
    prompt = next(source)
    assert prompt.text == "Solve: " + ROWS[prompt.id]["question"]
    assert prompt.system == "You are careful."
    assert source.state_dict()["seed"] == 4


def test_builtin_sources_are_the_shipped_tasks():
    source = build_prompt_source(spec("builtin:arith", prompt_template=">> {question}"), seed=9)
    assert len(source) == 2000
    assert next(source).text.startswith(">> ")
    with pytest.raises(
        UserError,
        match=r"dataset.path 'builtin:other': no shipped task named 'other' \(shipped: tiny, arith, tiny-tools\)",
    ):
        # past the schema, which refuses it first (test_recipes_schema)
        build_prompt_source(DatasetSpec.model_construct(path="builtin:other"))
