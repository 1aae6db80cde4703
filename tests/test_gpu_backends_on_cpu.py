"""The GPU backends' logic that runs anywhere: backend choice, vLLM's log-prob mode, the start-up
model folder, and the GPU trainer's math (it runs on CPU too, and must agree with the CPU
trainer)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import inspect
import json
import os
import sys
import types
from functools import partial
from typing import Any

import msgpack
import pytest
import torch
from runtime_helpers import token_batch

from recipes import UserError, apply_overrides, architecture, load_recipe, plan
from runtime.backends import OptimizerConfig, TitanReference, TitanTrainer, token_logprobs
from runtime.backends import build as services
from runtime.backends.blocks import micro_batches
from runtime.backends.fsdp_reference import GPUReference
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.backends.hf_generator import HFGenerator
from runtime.backends.scoring import response_logprobs
from runtime.backends.vllm_generator import (
    custom_all_reduce_allowed,
    engine_environment,
    logprobs_mode_for,
    request_tokens,
    write_model_dir,
)
from runtime.grpo import policy_loss
from runtime.models import ModelSpec

SPEC = ModelSpec.from_arch(architecture("qwen3", "tiny"))


def _batch(seed: int = 0, rows: int = 6, width: int = 20):
    # row 0 a shorter response, right-padded; row 1 no response token at all
    tokens, mask, _ = token_batch(SPEC.vocab_size, rows, width, seed=seed, short=7, empty=True)
    return tokens, mask


def test_vllm_logprob_mode_matches_the_trainer_distribution():
    assert logprobs_mode_for(1.0, 1.0) == "raw_logprobs"
    assert logprobs_mode_for(1.0, 0.9) == "raw_logprobs"  # raw: before top-p, as the contract
    assert logprobs_mode_for(0.7, 1.0) == "processed_logprobs"  # after temperature
    with pytest.raises(UserError, match="grpo.top_p"):
        logprobs_mode_for(0.7, 0.9)
    with pytest.raises(UserError, match="temperature"):
        logprobs_mode_for(0.0, 1.0)


def test_vllm_engine_environment_keeps_flashinfer_sampler_only_where_top_p_filters():
    # top-p 1.0, no top-k: vLLM samples on its PyTorch path; FlashInfer's sampler would only be
    # built for the warm-up
    assert engine_environment(1.0) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_LORA_ENABLE_DUAL_STREAM": None,
    }
    # top-p filters: vLLM's default (unset) stands, and the engine core may get its own process
    assert engine_environment(0.9, engine_in_process=False) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": None,
        "VLLM_LORA_ENABLE_DUAL_STREAM": None,
    }


def test_generator_lora_dual_stream_reaches_vllm_before_its_lora_layers_are_imported():
    import types

    from runtime.backends.vllm_generator import dual_stream_unreadable

    assert engine_environment(1.0, lora_dual_stream=True)["VLLM_LORA_ENABLE_DUAL_STREAM"] == "1"
    # not imported yet: vLLM reads the setting when the engine imports them
    assert dual_stream_unreadable(True, {}) is None
    # imported before with it off (no two-stream op in the module): asking for it on is refused,
    # not silently ignored; imported with the same setting: fine
    off = types.SimpleNamespace()
    on = types.SimpleNamespace(lora_linear_async=lambda *a: None)
    name = "vllm.lora.layers.base_linear"
    assert "imported in this process with it off" in dual_stream_unreadable(True, {name: off})
    assert "with it on" in dual_stream_unreadable(False, {name: on})
    assert dual_stream_unreadable(True, {name: on}) is None
    assert dual_stream_unreadable(False, {name: off}) is None


def test_a_tp_engine_on_shared_gpus_all_reduces_through_nccl():
    # vLLM's custom all-reduce cannot share CUDA-graph buffers of expandable segments between
    # its TP workers (cudaIpcGetMemHandle refuses them): the generator's allocator setting where
    # it shares its GPUs turns it off, and only there
    from runtime.control.startup import SHARED_GPU_ALLOC_CONF

    shared = {"PYTORCH_CUDA_ALLOC_CONF": SHARED_GPU_ALLOC_CONF}
    assert not custom_all_reduce_allowed(2, shared)
    assert not custom_all_reduce_allowed(
        4, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:TRUE"}
    )
    assert custom_all_reduce_allowed(1, shared)  # TP=1: no all-reduce at all
    assert custom_all_reduce_allowed(2, {})
    assert custom_all_reduce_allowed(2, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})


def test_an_episode_rounds_long_and_short_contexts_each_get_what_the_engine_leaves():
    # one round of episodes: the most any may take is 96, the longest context has 40 left
    assert request_tokens([[1] * 300, [1] * 984, [1] * 1000], 96, 1024) == [96, 40, 24]
    with pytest.raises(ValueError, match="a prompt of 1024 tokens leaves no room"):
        request_tokens([[1] * 10, [1] * 1024], 8, 1024)


def test_model_folder_describes_the_architecture(tmp_path):
    spec = services.model_spec(load_recipe("qwen3-1.7b"))
    folder = write_model_dir(spec, tmp_path / "m", eos_token_id=7, pad_token_id=0)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (spec.dim, spec.n_layers)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (151936, True)
    assert config["eos_token_id"] == 7
    assert not list(folder.glob("*.safetensors"))  # vLLM starts with load_format="dummy"


def test_backend_choice_on_cpu():
    recipe = load_recipe("tiny")
    settings = plan(recipe, 0).settings
    tokenizer = services.load_tokenizer(recipe)
    assert settings.generator.backend == "hf"
    assert isinstance(
        services.GeneratorConfig(recipe, settings.generator).build(tokenizer), HFGenerator
    )
    assert isinstance(services.TrainerConfig(recipe, settings.trainer).build(), TitanTrainer)
    assert isinstance(services.ReferenceConfig(recipe, settings.reference).build(), TitanReference)
    # a CPU plan refuses vLLM before anything starts; a proc given a GPU plan's vLLM settings
    # without a GPU refuses to build it
    with_vllm = apply_overrides(recipe, ["generator.backend=vllm"])
    with pytest.raises(UserError, match="generator.backend vllm needs a GPU, and this plan"):
        plan(with_vllm, 0)
    vllm = plan(load_recipe("tiny-gpu"), 1).settings.generator
    with pytest.raises(UserError, match="generator.backend vllm needs a GPU; this generator"):
        services.GeneratorConfig(recipe, vllm).build(tokenizer)
    with pytest.raises(
        UserError, match=r"generator.backend: Input should be 'auto', 'vllm' or 'hf'"
    ):
        apply_overrides(recipe, ["generator.backend=tensorrt"])


def test_response_only_logprobs_equal_full_logits_logprobs():
    tokens, mask = _batch()
    trainer = TitanTrainer(SPEC, OptimizerConfig(), temperature=0.7, seed=3)
    with torch.no_grad():
        full = token_logprobs(trainer.model(tokens), tokens, mask, 0.7)
        trainer.model._skip_lm_head = True
        mine = response_logprobs(trainer.model, tokens, mask, 0.7)
    torch.testing.assert_close(mine, full, rtol=0, atol=1e-5)
    assert mine[1].abs().sum() == 0 and mine[0, 15:].abs().sum() == 0


def test_micro_batches_cover_every_row_once():
    tokens = torch.zeros(10, 7, dtype=torch.long)
    parts = micro_batches(tokens, budget=20)  # 2 rows of 7 tokens fit
    assert [(p.start, p.stop) for p in parts] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert [(p.start, p.stop) for p in micro_batches(tokens, budget=3)][:2] == [(0, 1), (1, 2)]


def test_micro_batches_are_as_few_as_the_budget_allows_and_even():
    # 3 rows fit a budget of 64 at width 20: 7 rows are 3, 2, 2 (never a last slice of one row,
    # which would make the compiled blocks compile again), 128 rows of 25 are six of 21-22
    sizes = [p.stop - p.start for p in micro_batches(torch.zeros(7, 20), budget=64)]
    assert sizes == [3, 2, 2]
    sizes = [p.stop - p.start for p in micro_batches(torch.zeros(128, 650), budget=16384)]
    assert sizes == [22, 22, 21, 21, 21, 21]
    assert micro_batches(torch.zeros(0, 5), budget=64) == []
    parts = micro_batches(torch.zeros(1, 100), budget=10)  # a row wider than the budget
    assert [(p.start, p.stop) for p in parts] == [(0, 1)]


def test_gpu_trainer_step_matches_the_cpu_trainer():
    """Micro-batches, activation checkpointing and response-only logits change nothing."""
    tokens, mask = _batch(1)
    optim = OptimizerConfig(lr=1e-2, max_grad_norm=0.5)
    cpu = TitanTrainer(SPEC, optim, temperature=0.7, seed=1)
    gpu = FSDPTrainer(SPEC, optim, temperature=0.7, seed=1, device="cpu", tokens_per_micro_batch=40)
    old = cpu.logprobs(tokens, mask)
    torch.testing.assert_close(gpu.logprobs(tokens, mask), old, rtol=0, atol=1e-5)
    advantages = torch.linspace(-1, 1, tokens.shape[0])
    noisy_old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))
    kw = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.1)
    a = cpu.train_step(tokens, mask, advantages, noisy_old * mask, old, policy_loss, **kw)
    b = gpu.train_step(tokens, mask, advantages, noisy_old * mask, old, policy_loss, **kw)
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "response_tokens", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(
        gpu.logprobs(tokens, mask), cpu.logprobs(tokens, mask), atol=1e-4, rtol=0
    )


def test_gpu_trainer_publishes_hf_names_in_publish_dtype_and_resumes():
    trainer = FSDPTrainer(SPEC, OptimizerConfig(), seed=2, device="cpu")
    published = trainer.hf_state_dict()
    reference = TitanTrainer(SPEC, OptimizerConfig(), seed=2).hf_state_dict()
    assert published.keys() == reference.keys()
    assert all(t.dtype == torch.bfloat16 for t in published.values())
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, reference[name].to(torch.bfloat16), rtol=0, atol=0)

    tokens, mask = _batch(2)
    trainer.train_step(tokens, mask, torch.ones(6), None, None, policy_loss)
    resumed = FSDPTrainer(SPEC, OptimizerConfig(), seed=9, device="cpu")
    resumed.load_state_dict(trainer.state_dict())
    assert resumed.step == 1
    torch.testing.assert_close(resumed.logprobs(tokens, mask), trainer.logprobs(tokens, mask))


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_published_layout_is_known_without_gathering(family: str):
    """`hf_layout` gives what `hf_groups` yields (names, shapes, dtype) as meta tensors: a
    version's flat buffer is laid out before any of it is gathered."""
    spec = SPEC
    if family == "llama3":  # q/k rows permuted to HF's rotary layout, an untied head
        spec = dataclasses.replace(SPEC, family="llama3", tie_embeddings=False, norm_eps=1e-5)
    trainer = FSDPTrainer(spec, OptimizerConfig(), seed=2, device="cpu")
    layout = trainer.hf_layout()
    published = trainer.hf_state_dict()
    assert list(layout) == list(published)
    for name, tensor in published.items():
        assert layout[name].device.type == "meta"
        assert (layout[name].shape, layout[name].dtype) == (tensor.shape, tensor.dtype), name


def test_gpu_reference_scores_like_the_cpu_reference():
    tokens, mask = _batch(3)
    mine = GPUReference(
        SPEC, temperature=1.3, seed=4, device="cpu", dtype=torch.float32, tokens_per_micro_batch=30
    )
    theirs = TitanReference(SPEC, temperature=1.3, seed=4)
    torch.testing.assert_close(
        mine.logprobs(tokens, mask), theirs.logprobs(tokens, mask), atol=1e-5, rtol=0
    )


class _Model(torch.nn.Module):
    """What `load_on_worker` uses of vLLM's model: named parameters and `load_weights`,
    here writing each weight into its parameter (`writes=False`: matching names only)."""

    def __init__(self, writes: bool = True) -> None:
        super().__init__()
        self.writes = writes
        norm = torch.nn.Module()
        norm.weight = torch.nn.Parameter(torch.ones(4))
        self.model = torch.nn.ModuleDict({"norm": norm})

    def load_weights(self, weights):
        loaded = set()
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if self.writes:
                params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class _Worker:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


def test_a_generator_load_is_read_back_and_a_nan_version_named_as_such():
    """The generator reads the probe weight back from the model it runs after each load: a
    load that wrote nothing is one error, a version holding NaN another (NaN never equals
    itself, so it was reported as the first)."""
    from runtime.backends.vllm_worker import load_on_worker

    weights = {"model.norm.weight": torch.full((4,), 2.0)}
    model = _Model()
    assert load_on_worker(_Worker(model), weights) == []
    assert torch.equal(model.model["norm"].weight.detach(), weights["model.norm.weight"])
    with pytest.raises(RuntimeError, match="did not reach the model the engine runs"):
        load_on_worker(_Worker(_Model(writes=False)), weights)
    nan = {"model.norm.weight": torch.tensor([1.0, float("nan"), 1.0, 1.0])}
    with pytest.raises(RuntimeError, match="hold NaN or infinite values"):
        load_on_worker(_Worker(_Model()), nan)


# --- the engine core in this process or in one of its own ----------------------------------------


class _Rank:
    """What `vllm.distributed.get_tensor_model_parallel_rank` answers in the worker running."""

    value = 0


class _Engine:
    """The part of vLLM's `LLMEngine` the generator calls: LoRA registration and shutdown."""

    def __init__(self) -> None:
        self.added: list[tuple[str, list[str]]] = []
        self.engine_core = type("Core", (), {"shutdown": lambda self: None})()

    def add_lora(self, request) -> bool:
        self.added.append((request.lora_path, sorted(os.listdir(request.lora_path))))
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return True


def _tuple(obj: Any) -> list:
    if type(obj) is tuple:
        return list(obj)
    raise TypeError(f"msgpack carries no {type(obj).__name__}")


def _over_msgpack(value: Any) -> Any:
    """`value` after msgpack and back, with no hook for anything but plain values (exact
    types: a tensor, a class, a dtype, a torch.Size or a named tuple is refused)."""
    return msgpack.unpackb(msgpack.packb(value, default=_tuple, strict_types=True), raw=False)


class _LLM:
    """vLLM's `LLM` where no vLLM runs, on workers of this process that each hold a `_Model`.

    `collective_rpc` runs a call on each worker as vLLM would for the engine the environment
    asks for: in this process a function gets the worker and the arguments as they are; for
    an engine core of its own process the call is a method of `worker_extension_cls` (resolved
    from its name, mixed into the worker's class as vLLM does) by name, and the arguments and
    results go through msgpack and back (vLLM's client refuses a function there, and what
    msgpack cannot carry would not arrive)."""

    made: list[_LLM] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        worker_cls: type = _Worker
        if kwargs.get("worker_extension_cls"):
            module, _, name = kwargs["worker_extension_cls"].rpartition(".")
            worker_cls = type(
                "Worker", (_Worker, getattr(importlib.import_module(module), name)), {}
            )
        self.workers = [worker_cls(_Model()) for _ in range(kwargs["tensor_parallel_size"])]
        self.calls: list[tuple[Any, Any]] = []
        self.resets = 0
        self.llm_engine = _Engine()
        _LLM.made.append(self)

    def collective_rpc(self, method, args=()):
        if not self.in_process:
            if not isinstance(method, str):
                raise TypeError(f"{method!r} is not serializable without pickle")
            args = _over_msgpack(list(args))
        self.calls.append((method, args))
        out = []
        for rank, worker in enumerate(self.workers):
            _Rank.value = rank
            call = getattr(worker, method) if isinstance(method, str) else partial(method, worker)
            out.append(call(*args))
        if not self.in_process:
            out = _over_msgpack(out)
        return out

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.resets += 1
        return True


@pytest.fixture
def no_vllm(monkeypatch):
    """`vllm` as the generator imports it, with `_LLM` as its engine; the environment it sets
    put back afterwards."""
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    modules = {name: types.ModuleType(name) for name in _FAKE_VLLM}
    for name, attrs in _FAKE_VLLM.items():
        vars(modules[name]).update(attrs)
        modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, modules[name])
    modules["vllm"].envs = modules["vllm.envs"]
    _LLM.made.clear()
    return _LLM.made


_FAKE_VLLM: dict[str, dict[str, Any]] = {
    "vllm": {"LLM": _LLM},
    "vllm.envs": {"disable_envs_cache": lambda: None},
    "vllm.distributed": {"get_tensor_model_parallel_rank": lambda: _Rank.value},
    "vllm.lora": {},
    "vllm.lora.request": {
        "LoRARequest": lambda name, id_, path: types.SimpleNamespace(
            lora_name=name, lora_int_id=id_, lora_path=path
        )
    },
}
PROBE = {"model.norm.weight": torch.full((4,), 2.0)}


def _generator(separate: bool, tp: int = 1, **kwargs):
    from runtime.backends.vllm_generator import VLLMGenerator

    return VLLMGenerator(
        SPEC,
        eos_token_id=1,
        pad_token_id=0,
        max_model_len=64,
        tensor_parallel_size=tp,
        engine_in_process=not separate,
        **kwargs,
    )


def _flat(weights):
    from runtime.weights.flat import fill, flat_layout

    entries, total = flat_layout(weights)
    flat = torch.zeros(total, dtype=torch.uint8)
    fill(flat, entries, weights)
    return flat, entries


def _cuda_handle(tag: int, nbytes: int = 256):
    """A CUDA IPC handle laid out as torch's `reduce_tensor` makes one for a flat uint8 buffer
    on GPU 0 (no GPU here: made by hand)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor, (
        torch.Tensor,
        torch.Size([nbytes]),
        (1,),
        0,
        torch.TypedStorage,
        torch.uint8,
        0,
        bytes([tag]) * 64,
        nbytes,
        0,
        False,
        f"/torch_{tag}_1_0".encode(),
        tag,
        bytes([tag + 1]) * 64,
        True,
    )


def test_the_engine_mode_reaches_vllm_and_a_separate_engine_gets_the_worker_extension(no_vllm):
    inside, apart = _generator(separate=False), _generator(separate=True)
    assert (no_vllm[0].in_process, no_vllm[1].in_process) == (True, False)
    assert "worker_extension_cls" not in no_vllm[0].kwargs
    assert (
        no_vllm[1].kwargs["worker_extension_cls"] == "runtime.backends.vllm_worker.WorkerExtension"
    )
    assert (inside.ipc_opens, apart.ipc_opens, _generator(True, tp=2).ipc_opens) == (1, 1, 2)
    # the recipe's setting, through the generator proc's build (a GPU it is told it has)
    recipe = apply_overrides(load_recipe("tiny-gpu"), ["generator.engine=separate"])
    settings = plan(recipe, 1).settings.generator
    assert settings.engine == "separate"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(services, "device", lambda: torch.device("cuda"))
        m.setattr(torch.cuda, "device_count", lambda: 1)
        built = services.GeneratorConfig(recipe, settings).build(services.load_tokenizer(recipe))
    assert not built.engine_in_process and not no_vllm[-1].in_process
    assert no_vllm[-1].kwargs["worker_extension_cls"].endswith("WorkerExtension")


def test_a_separate_engine_loads_host_tensors_from_a_file_it_is_given_the_path_of(no_vllm):
    gen = _generator(separate=True)
    llm = no_vllm[0]
    gen.load_weights(PROBE)
    gen.load_flat(*_flat({"model.norm.weight": torch.full((4,), 3.0)}))  # a buffer on the host
    assert [method for method, _ in llm.calls] == ["forgesky_load_file"] * 2
    for _, (path,) in llm.calls:
        assert path.endswith(".safetensors") and not os.path.exists(path)  # read, then deleted
    assert torch.equal(llm.workers[0].model.model["norm"].weight.detach(), torch.full((4,), 3.0))
    assert llm.resets == 2  # the prefix cache after each version
    # a version that misses a parameter is refused by name, as in this process
    with pytest.raises(KeyError, match=r"no weight for \['model.norm.weight'\]"):
        gen.load_weights({})


def test_in_this_process_host_tensors_go_to_the_worker_as_they_are(no_vllm, monkeypatch):
    from runtime.backends.vllm_worker import load_on_worker
    from runtime.weights import ipc

    gen = _generator(separate=False)
    llm = no_vllm[0]
    gen.load_weights(PROBE)
    (method, (sent,)) = llm.calls[0]
    assert method is load_on_worker and sent is PROBE
    # a CUDA IPC version is opened here, by this process, and its views go the same way
    flat, entries = _flat(PROBE)
    opened = []
    monkeypatch.setattr(ipc, "open_ipc", lambda h: opened.append(h) or flat)
    handle = _cuda_handle(5)
    gen.load_ipc([handle], entries)
    assert opened == [handle] and llm.calls[1][0] is load_on_worker


def test_a_separate_engine_opens_each_cuda_ipc_handle_in_its_own_worker_from_plain_values(
    no_vllm, monkeypatch
):
    from runtime.weights import ipc

    weights = {"model.norm.weight": torch.full((4,), 4.0)}
    flat, entries = _flat(weights)
    opened = []

    def open_ipc(handle):  # the worker's side: what arrived, and who opened it
        opened.append((_Rank.value, handle))
        return flat

    monkeypatch.setattr(ipc, "open_ipc", open_ipc)
    gen = _generator(separate=True, tp=2)
    llm = no_vllm[0]
    handles = [_cuda_handle(1), _cuda_handle(2)]
    with pytest.raises(ValueError, match="1 CUDA IPC handles for 2 openers"):
        gen.load_ipc(handles[:1], entries)
    gen.load_ipc(handles, entries)
    ((method, _),) = llm.calls
    assert method == "forgesky_load_ipc"
    # each worker its own handle, once, as plain values equal to the handle's plain form
    assert [(rank, h["handle"]) for rank, h in opened] == [(0, b"\x01" * 64), (1, b"\x02" * 64)]
    assert [h for _, h in opened] == [ipc.plain_handle(h) for h in handles]
    for worker in llm.workers:
        assert torch.equal(worker.model.model["norm"].weight.detach(), weights["model.norm.weight"])
    assert llm.resets == 1


def test_a_plain_cuda_ipc_handle_opens_with_the_arguments_torch_exported(monkeypatch):
    """The plain form carries every argument of torch's `rebuild_cuda_tensor` (checked against
    its signature), survives msgpack, and gives them back as torch made them."""
    from torch.multiprocessing import reductions

    from runtime.weights import ipc

    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert len(params) == len(ipc._ARGS) + 1 and params[0] == "tensor_cls"
    handle = _cuda_handle(9)
    plain = ipc.plain_handle(handle)
    wire = _over_msgpack(plain)
    assert wire == plain
    seen = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: seen.append(a) or "opened")
    assert ipc.open_ipc(wire) == "opened"
    (args,) = seen
    assert args == handle[1] and args[0] is torch.Tensor and args[4] is torch.TypedStorage
    assert args[5] is torch.uint8 and isinstance(args[7], bytes)
    with pytest.raises(ValueError, match="only a CUDA IPC handle of a plain tensor"):
        ipc.plain_handle((reductions.rebuild_meta_tensor, handle[1]))
    with pytest.raises(ValueError, match="unknown storage 'FloatStorage'"):
        ipc.open_ipc({**plain, "storage": "FloatStorage"})
    with pytest.raises(ValueError, match="has the fields"):
        ipc.open_ipc({k: v for k, v in plain.items() if k != "event"})


def test_a_separate_engine_takes_lora_versions_from_a_folder_never_from_memory(no_vllm):
    from recipes.run_sections import Lora
    from runtime.models.peft_format import adapter_layout

    lora = Lora(rank=8, alpha=16)
    inside, apart = _generator(False, lora=lora), _generator(True, lora=lora)
    assert inside.slots.from_memory is not None and apart.slots.from_memory is None
    assert apart.ipc_opens == 1  # this process opens an adapter and writes it out
    tensors = {name: torch.zeros(shape) for name, shape in adapter_layout(SPEC, lora).items()}
    apart.incoming_version = 0
    apart.load_weights(tensors)
    ((path, files),) = no_vllm[1].llm_engine.added
    assert path == str(apart.slots.folder(0))
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert no_vllm[1].calls == [] and no_vllm[1].resets == 0  # no weight RPC, no reset
    apart.close()
    assert not apart.slots.root.exists()
