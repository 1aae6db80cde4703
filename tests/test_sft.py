"""SFT recipes: the catalog's, their minimum (the trainer's GPUs alone), plans, and the one-line
refusals of bad input."""

import json

import pytest
import torch

from launcher.cli import main
from recipes import (
    UserError,
    apply_overrides,
    dedicated_gpus,
    launch_gpus,
    load_recipe,
    minimum_gpus,
    plan,
    validate_recipe,
)
from recipes.loader import catalog_path

# name -> the trainer's GPUs (the recipe's minimum)
SFT = {"tiny-sft": 0, "qwen3-1.7b-sft": 1, "qwen3-8b-sft": 2, "llama3.1-8b-sft": 2}


def run_main(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("name", "need"), SFT.items())
def test_sft_recipes_need_the_trainers_gpus_alone(name, need):
    r = load_recipe(name)
    assert r.kind == "sft" and r.name == name
    assert dedicated_gpus(r) == minimum_gpus(r) == need
    p = plan(r, launch_gpus(r))
    assert [x.service for x in p.placements] == ["trainer"]
    assert p.generator_replicas == 0 and not p.reference_enabled and p.reward_procs == 0
    assert p.trainer_gpus == need
    text = catalog_path(name).read_text()
    assert (
        "Minimum: 0 GPUs (runs on CPU)" in text
        if need == 0
        else f"forgesky launch {name} --gpus {need}" in text
    )


def test_a_grpo_recipe_is_a_grpo_recipe():
    assert load_recipe("qwen3-1.7b").kind == "grpo"


def test_plan_explain_and_json_take_an_sft_plan(capsys):
    code, out, _ = run_main(capsys, "plan", "qwen3-8b-sft", "--gpus", "2", "--explain")
    assert code == 0 and "an SFT plan has one layout" in out
    code, out, _ = run_main(capsys, "plan", "qwen3-8b-sft", "--json")
    assert code == 0 and '"trainer_gpus": 2' in out


def test_an_sft_plan_on_more_gpus_gives_the_trainer_all_of_them():
    p = plan(load_recipe("qwen3-1.7b-sft"), 4)
    assert p.placements[0].gpus == (0, 1, 2, 3) and p.minimum_gpus == 1
    assert p.memory["trainer"] < plan(load_recipe("qwen3-1.7b-sft"), 1).memory["trainer"]


def test_lora_applies_to_sft():
    r = apply_overrides(load_recipe("qwen3-8b-sft"), ["model.lora.rank=16"])
    assert r.model.lora.rank == 16
    assert "LoRA rank 16" in plan(r, 2).lora
    with pytest.raises(UserError, match="model.lora.targets: 'wq' is not a qwen3 projection"):
        apply_overrides(r, ["model.lora.targets=[wq]"])


def test_the_recipes_table_lists_sft_beside_grpo(capsys):
    code, out, _ = run_main(capsys, "recipes")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
    assert rows["qwen3-8b-sft"][3] == "2" and rows["tiny-sft"][3] == "0"
    assert "qwen3-8b" in rows


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", "qwen3-8b-sft", "--gpus", "1"],
            "qwen3-8b-sft needs at least 2 x H100 (the trainer's GPUs, layout.trainer.gpus), "
            "got --gpus 1\n",  # the whole line: its trainer does not fit 1
        ),
        (
            ["plan", "qwen3-8b-sft", "--gpus", "1", "--set", "model.lora.rank=16"],
            "got --gpus 1; its trainer fits 1 (--set layout.trainer.gpus=1)",
        ),
        (["plan", "qwen3-1.7b-sft", "--gpus", "9"], "an SFT trainer runs on one node"),
        (
            ["validate", "tiny-sft", "--set", "dataset.max_tokens=100"],
            "dataset.max_tokens: 100 exceeds the qwen3 tiny context of 64 tokens",
        ),
        (
            ["plan", "tiny-sft", "--set", "trainer.tokens_per_micro_batch=16"],
            "trainer.tokens_per_micro_batch: 16 is less than dataset.max_tokens 32",
        ),
        (
            ["plan", "tiny-sft", "--set", "sft.loss=grpo"],
            "valid keys under sft: attention, checkpoint_finish_s",
        ),
        (["plan", "tiny-sft", "--set", "dataset.format=chat"], "dataset.format"),
        (
            ["plan", "qwen3-1.7b-sft", "--set", "eval.split=train_sft"],
            "eval.split: 'train_sft' is the split the run trains on",
        ),
        (
            ["validate", "tiny-sft", "--set", "eval.samples=2"],
            "eval.samples: 2 is fewer than eval.k 4",
        ),
        (["plan", "tiny-sft", "--set", "eval.reward=nope"], "eval.reward: unknown reward 'nope'"),
        (
            ["plan", "qwen3-8b-sft", "--set", "layout.trainer.gpus=1"],
            "layout.trainer.gpus: the qwen3 8b trainer does not fit 1 x H100",
        ),
        (
            ["validate", "tiny-sft", "--set", "sft.attention=varlen"],
            "sft.attention: varlen trains on GPUs only; on accelerator cpu use auto or document",
        ),
    ],
)
def test_bad_sft_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_sft_runs_take_the_trainer_ranks_on_gpus_and_on_cpu_with_several_ranks():
    from runtime.sft.ranks import on_ranks, peak_flops, trainer_settings

    tiny = load_recipe("tiny-sft")
    assert not on_ranks(tiny, plan(tiny, 0))  # one process, the CPU trainer
    two = apply_overrides(tiny, ["trainer.ranks=2"])
    cpu = trainer_settings(two, plan(two, 0)).trainer
    assert on_ranks(two, plan(two, 0)) and cpu.ranks == 2
    assert cpu.tokens_per_micro_batch == 128 and not cpu.compile
    assert peak_flops(plan(two, 0), 2) is None
    gpu = load_recipe("qwen3-1.7b-sft")
    gpu_plan = plan(gpu, 1)
    settings = trainer_settings(gpu, gpu_plan).trainer
    assert on_ranks(gpu, gpu_plan) and settings.ranks == 1
    assert settings.tokens_per_micro_batch >= gpu.dataset.max_tokens
    assert peak_flops(gpu_plan, 1) > 1e14  # an H100's bf16 peak


def test_the_sft_plan_shows_the_trainer_settings_the_run_takes():
    from runtime.sft.ranks import trainer_settings

    gpu = load_recipe("qwen3-1.7b-sft")
    for gpus, accelerator in ((1, "H200"), (2, "H200"), (1, "H100")):
        p = plan(gpu, gpus, accelerator=accelerator)
        runs = trainer_settings(gpu, p).trainer
        text = p.describe()
        assert f"settings (* planned for {accelerator}; set any with --set" in text
        trainer_line = next(x for x in text.splitlines() if x.startswith("  trainer "))
        assert (
            f"ranks {gpus}*, tokens_per_micro_batch {runs.tokens_per_micro_batch}*" in trainer_line
        )
        assert ("gather_once" in trainer_line) == (gpus > 1)
        assert "  sft         attention varlen*, packing best_fit" in text
    # what the recipe sets is shown unmarked, and is what the run takes
    fixed = apply_overrides(gpu, ["trainer.tokens_per_micro_batch=4096", "sft.attention=flex"])
    p = plan(fixed, 1, accelerator="H200")
    assert trainer_settings(fixed, p).trainer.tokens_per_micro_batch == 4096
    assert "tokens_per_micro_batch 4096," in p.describe()
    assert "attention flex, packing best_fit" in p.describe()
    assert (
        p.to_dict()["sft_settings"] and "sft_settings" not in plan(load_recipe("tiny"), 0).to_dict()
    )


def test_the_sft_plan_refuses_ranks_it_would_not_run_and_says_what_one_rank_leaves_out(capsys):
    # the trainer takes a rank a GPU: a trainer.ranks other than --gpus is refused, not replaced
    code, out, err = run_main(
        capsys, "plan", "qwen3-1.7b-sft", "--gpus", "4",
        "--set", "layout.trainer.gpus=2", "--set", "trainer.ranks=2",
    )  # fmt: skip
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "trainer.ranks 2" in err and "--gpus 4" in err and "--gpus 2" in err
    # gather_once asked for on one rank: said, not dropped
    code, out, _ = run_main(
        capsys, "plan", "qwen3-1.7b-sft", "--gpus", "1", "--set", "trainer.gather_once=true"
    )
    assert code == 0 and "gather_once off (one rank: nothing to gather)" in out
    # --json: the settings as data, the same values the lines show
    code, out, _ = run_main(capsys, "plan", "qwen3-1.7b-sft", "--gpus", "2", "--json")
    data = json.loads(out)["sft_settings"]
    gpu = load_recipe("qwen3-1.7b-sft")
    lines = plan(gpu, 2).describe()
    trainer = data["trainer"]
    assert trainer["ranks"] == 2 and trainer["compile"] is True
    assert f"tokens_per_micro_batch {trainer['tokens_per_micro_batch']}*" in lines
    assert f"attention {data['attention']}*, packing {data['packing']}" in lines
    assert (
        "trainer.tokens_per_micro_batch" in data["planned"] and "sft.attention" in data["planned"]
    )


def test_packed_rows_take_varlen_on_gpus_and_the_dense_mask_on_the_cpu():
    from recipes.sft import packed_attention

    gpu = load_recipe("qwen3-1.7b-sft")
    assert packed_attention(gpu, gpu=True) == "varlen"
    assert (
        packed_attention(apply_overrides(gpu, ["sft.attention=document"]), gpu=True) == "document"
    )
    assert packed_attention(load_recipe("tiny-sft"), gpu=False) == "document"


def test_varlen_runs_on_torchs_own_flash_attention_not_the_fa3_package():
    from torchtitan.models.common.attention import current_flash_attention_impl

    from runtime.backends.build import model_spec
    from runtime.models import build_model
    from runtime.models.packing import TorchVarlenAttention

    before = current_flash_attention_impl()
    model = build_model(model_spec(load_recipe("tiny-sft")), attention="varlen")
    layers = [m for m in model.modules() if isinstance(m, TorchVarlenAttention)]
    assert len(layers) == load_recipe("tiny-sft").arch.n_layers
    assert current_flash_attention_impl() == before  # no FA3/FA4 switched on
    meta = model.get_attention_masks(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]]))
    assert meta.cu_seq_q.tolist() == [0, 3, 7, 8] and meta.max_q == 4


def test_step_flops_count_each_rows_attention():
    from runtime.backends.build import model_spec
    from runtime.sft.run import step_flops

    spec = model_spec(load_recipe("tiny-sft"))
    whole, halves = step_flops(spec, [64], False), step_flops(spec, [32, 32], False)
    assert halves < whole  # two rows of 32 attend less than one of 64
    assert step_flops(spec, [64], True) < whole  # LoRA's frozen base takes no weight gradient
    assert halves > 6 * spec.num_params() * 64


def test_a_recipe_trains_by_grpo_or_sft_not_both():
    data = load_recipe("tiny").model_dump()
    data["sft"] = load_recipe("tiny-sft").sft.model_dump()
    with pytest.raises(UserError, match="a recipe trains by grpo or by sft, not both"):
        validate_recipe(data, "mixed.yaml")


def test_an_sft_recipe_without_its_data_section_names_it():
    data = load_recipe("tiny-sft").model_dump()
    del data["dataset"]
    with pytest.raises(UserError, match="mine.yaml: dataset: required field is missing"):
        validate_recipe(data, "mine.yaml")


def test_pass_at_k_needs_a_reward():
    data = load_recipe("tiny-sft").model_dump()
    data["eval"] |= {"reward": None, "k": 4}
    with pytest.raises(UserError, match="eval.k: pass@k is scored by a reward; name one as eval"):
        validate_recipe(data, "mine.yaml")
    data["eval"] |= {"k": 1}
    assert validate_recipe(data, "mine.yaml").eval.reward is None


def test_sft_data_fields_by_format():
    r = load_recipe("tiny-sft")
    assert r.dataset.fields == ("messages",)
    pc = apply_overrides(r, ["dataset.format=prompt_completion", "dataset.prompt_field=q"])
    assert pc.dataset.fields == ("q", "completion")


def _turns(answer):
    return {
        "messages": [{"role": "user", "content": "12"}, {"role": "assistant", "content": answer}]
    }


# case -> (the data file's name, its text, what the one line says)
BAD_DATA = {
    "fields": (
        "d.jsonl",
        json.dumps({"conversation": [], "id": 1}) + "\n",
        "dataset.messages_field 'messages' is not a field of the data (format messages); "
        "its fields: conversation, id",
    ),
    "empty-assistant": (
        "d.jsonl",
        json.dumps(_turns("23")) + "\n" + json.dumps(_turns(" ")) + "\n",
        "row 1: no assistant turn with content (an empty assistant turn set",
    ),
    "not-turns": (
        "d.json",
        json.dumps([_turns("23"), {"messages": "12"}]),
        "row 1: its 'messages' is not a list of {role, content} turns",
    ),
    "not-json": ("d.jsonl", json.dumps(_turns("23")) + "\n{oops\n", "line 2 column 2: not JSON ("),
    "no-rows": ("d.jsonl", "\n", "has no rows"),
    "csv-fields": ("d.csv", "prompt,answer\n12,23\n", "its fields: prompt, answer"),
}


@pytest.mark.parametrize("command", ["validate", "plan", "local"])
@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_local_sft_data_is_one_line_and_exit_2_before_anything_starts(
    tmp_path, capsys, command, case
):
    """Read with the standard library before anything starts: no torch, `datasets` or
    tokenizer is imported to say it (tests/test_sft.py's other imports hold none of them)."""
    import sys

    name, text, message = BAD_DATA[case]
    data = tmp_path / name
    data.write_text(text)
    argv = [command, "tiny-sft", "--set", f"dataset.path={data}"]
    if name.endswith(".csv"):
        argv += ["--set", "dataset.format=prompt_completion"]
    run_dir = tmp_path / "run"
    if command == "local":
        argv += ["--run-dir", str(run_dir)]
    heavy = {"torch", "datasets", "transformers"} & set(sys.modules)
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and f"dataset '{data}'" in err and message in err, err
    assert not run_dir.exists()
    if not heavy:  # run alone, this file imports none of them: the check did not either
        assert not {"torch", "datasets", "transformers"} & set(sys.modules)


@pytest.mark.parametrize("command", ["validate", "plan", "local"])
@pytest.mark.parametrize("setting", ["dataset.path", "eval.path"])
def test_local_sft_data_that_is_not_there_is_named_by_its_setting(
    tmp_path, capsys, command, setting
):
    missing = tmp_path / "gone.jsonl"
    run_dir = tmp_path / "run"
    argv = [command, "tiny-sft", "--set", f"{setting}={missing}"]
    argv += ["--run-dir", str(run_dir)] * (command == "local")
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"{setting} '{missing}': no such file or folder" in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("recipe", "setting"),
    [("tiny", "dataset.path"), ("qwen3-1.7b", "model.hf_id"), ("qwen3-1.7b", "model.tokenizer")],
)
def test_any_recipes_local_path_that_is_not_there_is_refused_by_plan(
    tmp_path, capsys, recipe, setting
):
    missing = tmp_path / ("gone.jsonl" if setting == "dataset.path" else "gone")
    code, out, err = run_main(capsys, "plan", recipe, "--set", f"{setting}={missing}")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"{setting} '{missing}': no such file or folder" in err, err


def test_a_fault_in_the_held_out_file_names_eval_path(tmp_path, capsys):
    data = tmp_path / "held_out.jsonl"
    data.write_text(json.dumps({"conversation": []}) + "\n")
    code, out, err = run_main(capsys, "plan", "tiny-sft", "--set", f"eval.path={data}")
    assert code == 2 and err.count("\n") == 1, err
    assert f"eval.path: dataset '{data}': dataset.messages_field 'messages'" in err, err


def test_a_local_tokenizer_without_a_chat_template_is_refused_before_anything_starts(
    tmp_path, capsys
):
    from runtime.tasks.tiny import tokenizer

    tok = tokenizer()
    tok.save_pretrained(tmp_path / "with")
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "without")
    for command in ("validate", "plan", "local"):
        argv = [command, "tiny-sft", "--set", f"model.tokenizer={tmp_path / 'without'}"]
        run_dir = tmp_path / "run"
        code, out, err = run_main(
            capsys, *argv, *(["--run-dir", str(run_dir)] * (command == "local"))
        )
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert "model.tokenizer: the tokenizer has no chat template" in err, err
        assert not run_dir.exists()
    code, out, err = run_main(
        capsys, "plan", "tiny-sft", "--set", f"model.tokenizer={tmp_path / 'with'}"
    )
    assert code == 0, err


def test_rows_past_those_looked_at_first_are_checked_as_the_run_loads_them(
    tmp_path, capsys, monkeypatch
):
    import recipes.sft_rows

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_turns("23")) + "\n" + json.dumps(_turns("")) + "\n")
    monkeypatch.setattr(recipes.sft_rows, "ROWS_LOOKED_AT", 1)
    code, _, err = run_main(capsys, "plan", "tiny-sft", "--set", f"dataset.path={data}")
    assert code == 0, err
    from runtime.sft.run import run

    recipe = apply_overrides(load_recipe("tiny-sft"), [f"dataset.path={data}"])
    with pytest.raises(UserError, match="row 1: no assistant turn with content"):
        run(recipe, tmp_path / "run", log=lambda _: None)
    assert not (tmp_path / "run").exists()
