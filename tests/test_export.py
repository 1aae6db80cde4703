"""A model out: the trained policy as a Hugging Face folder that transformers loads with the
runtime's own logits; `forgesky export` from any committed checkpoint, and to the Hub (only the
upload itself is replaced)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from runtime_helpers import tiny_run_dir
from test_models import LLAMA, QWEN
from transformers import AutoModelForCausalLM, AutoTokenizer

import runtime.tasks.tiny as tiny
from launcher.cli import main
from recipes import load_recipe
from runtime.backends import build, checkpoint_read
from runtime.backends.titan_trainer import OptimizerConfig, TitanTrainer
from runtime.grpo import policy_loss
from runtime.models import build_hf_model, load_pretrained
from runtime.models.export import write_hf_model
from runtime.tasks.arith import tokenizer as char_tokenizer

# the shipped character tokenizer needs ~100 ids
SPECS = {
    "qwen3": dataclasses.replace(QWEN, vocab_size=128),
    "llama3-untied": dataclasses.replace(LLAMA, vocab_size=128, tie_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_trained_model_reloads_in_transformers_with_the_runtimes_logits(
    tmp_path, token_batch, name
):
    spec = SPECS[name]
    torch.manual_seed(0)
    build_hf_model(spec).save_pretrained(tmp_path / "start", safe_serialization=True)
    trainer = TitanTrainer(
        spec, OptimizerConfig(lr=1e-2), weights=load_pretrained(str(tmp_path / "start"), spec)
    )
    start = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    tokens, mask, advantages = token_batch(spec.vocab_size, rows=4, width=24)
    for _ in range(2):
        trainer.train_step(tokens, mask, advantages, None, None, policy_loss)
    tok = char_tokenizer(spec.vocab_size)
    folder = write_hf_model(
        trainer.hf_state_dict(), spec, tmp_path / "model", tokenizer=tok, dtype="float32"
    )
    assert not (tmp_path / "model.partial").exists()
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert (
        type(hf).__name__
        == {"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}[spec.family]
    )
    changed = [k for k, v in hf.state_dict().items() if k in start and not torch.equal(v, start[k])]
    assert changed  # the export holds the trained weights, not the ones it started from
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=tokens).logits, trainer.model(tokens), atol=1e-5, rtol=0
        )
    # the same model through a DCP checkpoint, read back the way `forgesky export` reads one
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    trainer.checkpoint_written(wait=True)
    from runtime.models.hf import to_hf

    again = write_hf_model(
        to_hf(checkpoint_read.model_weights(tmp_path / "ckpt", spec), spec),
        spec,
        tmp_path / "from_checkpoint",
        tokenizer=tok,
        dtype="float32",
    )
    hf_again = AutoModelForCausalLM.from_pretrained(again).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            hf_again(input_ids=tokens).logits, hf(input_ids=tokens).logits, atol=0, rtol=0
        )
    reloaded = AutoTokenizer.from_pretrained(folder)
    assert reloaded("1+1")["input_ids"] == tok("1+1")["input_ids"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id and generation["do_sample"]


def test_a_bf16_export_is_bf16_on_disk(tmp_path):
    spec = SPECS["qwen3"]
    trainer = TitanTrainer(spec, OptimizerConfig(lr=1e-3))
    folder = write_hf_model(
        trainer.hf_state_dict(), spec, tmp_path / "m", tokenizer=char_tokenizer(128)
    )
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny run directory with its recorded recipe and committed checkpoints 3 and 7."""
    return tiny_run_dir(tmp_path_factory.mktemp("run"), steps=(3, 7))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def test_forgesky_export_writes_the_newest_or_the_named_checkpoint(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), "--out", str(tmp_path / "newest")]) == 0
    assert main(["export", str(run_dir), "--step", "3", "--out", str(tmp_path / "three")]) == 0
    out = capsys.readouterr().out
    assert "exporting step 7 of" in out and "exporting step 3 of" in out
    assert json.loads((tmp_path / "newest/forgesky.json").read_text())["step"] == 7
    spec = build.model_spec(load_recipe("tiny"))
    for step, name in ((7, "newest"), (3, "three")):
        weights = checkpoint_read.model_weights(run_dir / f"checkpoints/step_{step:06d}", spec)
        model = build_hf_model(spec)
        from runtime.models.hf import to_hf

        model.load_state_dict(to_hf(weights, spec), strict=False)
        got = _weights(tmp_path / name)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(got[key], value, atol=0, rtol=0)
    # its tokenizer encodes any text (a character outside the task's as <unk>), like the
    # runtime's, into ids its model takes
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "newest")
    text = "any text ✓ 漢字"
    ids = tokenizer(text)["input_ids"]
    assert ids == tiny.tokenizer()(text)["input_ids"] and set(ids[1:]) == {13}
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "newest")(torch.tensor([ids]))
    assert logits.logits.shape == (1, len(ids), spec.vocab_size)
    # and the exported folder evaluates like the checkpoint it came from
    for i, source in enumerate([str(run_dir), str(tmp_path / "newest")]):
        args = ["eval", source, "--recipe", "tiny", "--out", str(tmp_path / f"e{i}.json")]
        assert main(args) == 0
    first, second = (json.loads((tmp_path / f"e{i}.json").read_text()) for i in range(2))
    assert first["eval/pass@1"] == second["eval/pass@1"]
    assert first["eval/reward_mean"] == second["eval/reward_mean"]


class _FakeHub:
    """Stands in for huggingface_hub.HfApi: the one call that would reach the Hub."""

    calls: list[tuple[str, dict]] = []

    def __init__(self, token=None):
        self.calls.append(("token", {"token": token}))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):
        files = sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())
        self.calls.append(("upload_folder", {**kwargs, "files": files}))


def test_push_to_hub_uploads_the_folder_with_the_token(run_dir, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    _FakeHub.calls = []
    args = ["export", str(run_dir), "--out", str(tmp_path / "m"), "--push-to-hub", "me/tiny"]
    assert main(args) == 0
    calls = dict(_FakeHub.calls)
    assert calls["token"] == {"token": "hf_secret"}
    assert calls["create_repo"] == {"repo_id": "me/tiny", "private": True, "exist_ok": True}
    upload = calls["upload_folder"]
    assert upload["repo_id"] == "me/tiny" and "model.safetensors" in upload["files"]
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(upload["files"])


@pytest.mark.parametrize("command", ["export", "eval"])
def test_a_run_whose_only_checkpoint_is_damaged_gets_one_line_for_its_command(
    tmp_path, capsys, command
):
    from runtime.control import checkpoint

    step = tmp_path / "run/checkpoints/step_000003"
    step.mkdir(parents=True)
    (step / "trainer.pt").write_bytes(b"cut")
    (step / checkpoint.MARKER).write_text(json.dumps({"step": 3, "files": {"trainer.pt": 100}}))
    argv = [command, str(tmp_path / "run")]
    if command == "export":
        argv += ["--out", str(tmp_path / "m")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # no warning line before it
    assert "trainer.pt: checkpoint file is cut short" in err[0]
    assert f"{command} needs a committed checkpoint that is whole" in err[0]
    assert not (tmp_path / "m").exists()


def test_a_hub_out_of_reach_leaves_the_export_and_says_so_in_one_line(
    run_dir, tmp_path, monkeypatch, capsys
):
    import httpx
    import huggingface_hub

    class Offline(_FakeHub):
        def create_repo(self, *args, **kwargs):
            raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    out = tmp_path / "m"
    assert main(["export", str(run_dir), "--out", str(out), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not reach the Hub to push me/tiny (ConnectError" in err[0]
    assert f"the model is in {out}" in err[0] and (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["{run}", "--out", " "], "--out is blank"),
        (
            ["{run}", "--out", "{tmp}/m", "--push-to-hub", "bad repo name!!"],
            "is not a Hub repository name",
        ),
        (["{run}", "--out", "{tmp}/m", "--step", "5"], "no committed checkpoint of step 5"),
        (["{run}", "--out", "{tmp}/m", "--push-to-hub", "me/x"], "needs a Hugging Face token"),
        (["{tmp}/nothing", "--out", "{tmp}/m"], "no such file or directory"),
        (["{tmp}/hf", "--out", "{tmp}/m"], "is a model folder already"),
        (["{tmp}/adapter", "--out", "{tmp}/m"], "is an adapter folder already"),
        (
            ["{run}", "--out", "{tmp}/m", "--merge"],
            "export: --merge: {run} trained every parameter; its export is a full model "
            "already (drop --merge)",
        ),
        (
            ["{run}", "--out", "{tmp}/m", "--recipe", "tiny-lora", "--merge"],
            "export: the run trained every parameter and --recipe tiny-lora is a LoRA recipe",
        ),
        (["{tmp}/empty", "--out", "{tmp}/m"], "no committed checkpoint"),
        (["{run}", "--out", "{tmp}/hf"], "--out {tmp}/hf is not empty"),
        (["{run}", "--out", "{run}"], "is not empty"),
        (["{run}", "--out", "{tmp}/hf/config.json"], "is a file"),
    ],
)
def test_bad_exports_are_one_line_and_exit_2(
    run_dir, tmp_path, capsys, monkeypatch, args, expected
):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    if "bad repo name!!" in args:
        monkeypatch.setenv("HF_TOKEN", "hf_secret")  # the name is what is wrong
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text("{}")
    (tmp_path / "hf/model.safetensors").write_bytes(b"")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter/adapter_config.json").write_text("{}")
    (tmp_path / "adapter/adapter_model.safetensors").write_bytes(b"")
    # a run that never committed a checkpoint: its recipe, and one write cut short
    (tmp_path / "empty/checkpoints/step_000002.partial").mkdir(parents=True)
    (tmp_path / "empty/config.json").write_text((run_dir / "config.json").read_text())
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    argv = ["export", *(a.format(run=run_dir, tmp=tmp_path) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    expected = expected.format(tmp=tmp_path, run=run_dir)
    assert len(err) == 1 and err[0].startswith("forgesky: error: export: ") and expected in err[0]
    # nothing overwritten: the run and the folder that was in the way are as they were
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert (tmp_path / "hf/config.json").read_text() == "{}"
    assert not list(tmp_path.glob("*.partial"))


def test_an_empty_folder_takes_the_export(run_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty/config.json").exists()


def test_weights_that_are_views_into_one_buffer_export(tmp_path):
    """Gathered or flat weights share one storage; each still lands in the file."""
    spec = SPECS["qwen3"]
    state = TitanTrainer(spec, OptimizerConfig(lr=1e-3)).hf_state_dict()
    flat = torch.cat([v.reshape(-1) for v in state.values()])
    views, offset = {}, 0
    for key, value in state.items():
        views[key] = flat[offset : offset + value.numel()].view(value.shape)
        offset += value.numel()
    folder = write_hf_model(
        views, spec, tmp_path / "m", tokenizer=char_tokenizer(128), dtype="float32"
    )
    got = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for key, value in state.items():
        torch.testing.assert_close(got[key], value, atol=0, rtol=0)


def test_a_bf16_export_reads_the_checkpoint_straight_into_bf16(run_dir, tmp_path):
    # the fp32 parameters are rounded as they are read (2 bytes a parameter in host memory),
    # to the same numbers a cast of the fp32 model gives
    spec = build.model_spec(load_recipe("tiny"))
    path = run_dir / "checkpoints/step_000007"
    fp32 = checkpoint_read.model_weights(path, spec)
    _, groups = checkpoint_read.model_weight_groups(path, spec, torch.bfloat16)
    bf16 = {k: v for group in groups for k, v in group.items()}
    assert fp32.keys() == bf16.keys()
    params = {k for k, v in bf16.items() if v.dtype == torch.bfloat16}
    assert len(params) >= len(fp32) - 2  # all but the RoPE tables
    for key in params:
        assert torch.equal(bf16[key], fp32[key].to(torch.bfloat16)), key
    # `forgesky export` of a run whose recipe exports bf16 writes those numbers
    bf16_run = tmp_path / "run"
    bf16_run.mkdir()
    recorded = json.loads((run_dir / "config.json").read_text())
    recorded["model"]["dtype"] = "bfloat16"
    (bf16_run / "config.json").write_text(json.dumps(recorded))
    (bf16_run / "checkpoints").symlink_to(run_dir / "checkpoints")
    assert main(["export", str(bf16_run), "--out", str(tmp_path / "m")]) == 0
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype="auto").state_dict()
    from runtime.models.hf import to_hf

    want = to_hf({k: v.to(torch.bfloat16) for k, v in fp32.items()}, spec)
    compared = [key for key in got if key in want]
    assert len(compared) >= len(want) - 1  # a tied output projection is the embedding
    for key in compared:
        assert torch.equal(got[key], want[key]), key
    assert {v.dtype for v in got.values() if v.is_floating_point()} == {torch.bfloat16}


def test_an_export_handed_over_a_group_at_a_time_writes_each_file_as_it_fills(tmp_path):
    from runtime.models.export import write_hf_model_groups
    from runtime.models.hf import to_hf

    spec = SPECS["llama3-untied"]
    trainer = TitanTrainer(spec, OptimizerConfig(lr=1e-3))
    whole = trainer.hf_state_dict()
    tok = char_tokenizer(spec.vocab_size)
    one = write_hf_model(whole, spec, tmp_path / "one", tokenizer=tok, dtype="float32")
    # the blocks one after another, as a sharded trainer gathers them; files of ~1/4 the model
    titan = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    blocks = sorted({k.split(".")[1] for k in titan if k.startswith("layers.")}, key=int)
    parts = [{k: v for k, v in titan.items() if not k.startswith("layers.")}]
    parts += [{k: v for k, v in titan.items() if k.startswith(f"layers.{b}.")} for b in blocks]
    layout = {
        k: torch.empty(v.shape, dtype=v.dtype, device="meta")
        for part in parts
        for k, v in to_hf(part, spec).items()
    }
    total = sum(t.numel() * 4 for t in layout.values())
    out = tmp_path / "many"
    seen: list[set[str]] = []

    def groups():
        for part in parts:
            seen.append({p.name for p in out.with_name("many.partial").glob("*.safetensors")})
            yield to_hf(part, spec)

    many = write_hf_model_groups(
        groups(), layout, spec, out, tokenizer=tok, dtype="float32", max_shard_bytes=total // 4
    )
    files = sorted(p.name for p in many.glob("*.safetensors"))
    assert len(files) >= 4 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == total
    # each file was on disk before the last groups were asked for: never the whole model held
    assert 0 < len(seen[-1]) < len(files)
    a = AutoModelForCausalLM.from_pretrained(one).state_dict()
    b = AutoModelForCausalLM.from_pretrained(many).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_export_missing_a_tensor_of_its_layout_leaves_nothing(tmp_path):
    from runtime.models.export import write_hf_model_groups

    spec = SPECS["qwen3"]
    whole = TitanTrainer(spec, OptimizerConfig(lr=1e-3)).hf_state_dict()
    layout = {k: v.to("meta") for k, v in whole.items()}
    short = {k: v for k, v in whole.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="never came, e.g. 'model.norm.weight'"):
        write_hf_model_groups([short], layout, spec, tmp_path / "m", tokenizer=char_tokenizer(128))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", ["cut short", "overwritten"])
def test_an_export_of_a_damaged_checkpoint_is_one_line_and_writes_nothing(
    run_dir, tmp_path, capsys, how
):
    # cut short: its marker's sizes no longer hold, said before anything is read; overwritten
    # (sizes whole): the read fails half-way through the streamed export
    import shutil

    damaged = tmp_path / "run"
    shutil.copytree(run_dir, damaged)
    for f in (damaged / "checkpoints/step_000007/trainer").glob("*.distcp"):
        size = f.stat().st_size
        f.write_bytes(f.read_bytes()[:64] if how == "cut short" else bytes(size))
    out = tmp_path / "m"
    for source in (
        [str(damaged), "--step", "7"],
        [str(damaged / "checkpoints/step_000007")],
    ):
        assert main(["export", *source, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("forgesky: error: export: "), err
        expected = "is cut short or damaged" if how == "cut short" else "cannot be read"
        assert expected in err[0], err
        assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_a_disk_without_room_for_the_model_is_one_line_and_writes_nothing(
    run_dir, tmp_path, capsys, monkeypatch
):
    """`forgesky export` to a disk that cannot hold the model is refused before anything is
    read; at the end of a run the same shortage is a warning naming `forgesky export`, and
    the run does not start a write that would fill the disk."""
    import os

    from recipes.memory import model_file_bytes
    from runtime.control.config import RunConfig
    from runtime.control.run import model_room_warning

    recipe = load_recipe("tiny")
    need = model_file_bytes(recipe)

    def disk(path):  # a disk with a tenth of the model's size free
        return os.statvfs_result((1, 1, 10 * need, need // 10, need // 10, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", disk)
    out = tmp_path / "m"
    assert main(["export", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"forgesky: error: export: --out {out} has "), err
    assert "free and the model needs" in err[0] and "disk with room" in err[0]
    assert not out.exists()
    config = RunConfig(recipe=recipe, plan=None, run_dir=tmp_path / "run")
    warning = model_room_warning(config)
    assert warning is not None and warning.startswith(
        f"forgesky: warning: the model is not written: {tmp_path / 'run'} has "
    )
    assert f"forgesky export {tmp_path / 'run'} --out DIR" in warning
    monkeypatch.undo()
    assert model_room_warning(config) is None
