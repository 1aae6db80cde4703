"""The vLLM generator serving the policy as a LoRA adapter, on one GPU (run with `pytest -m gpu` on
a GPU machine with vllm).

The base is a small random Qwen3 saved as a Hugging Face folder, which the engine loads itself;
versions are adapters alone (PEFT names): the first handed to vLLM from memory to build and
activate, the later ones written into its GPU slot in place (runtime.backends.vllm_lora_slot),
or, as for an engine of other processes (one test builds an engine whose core runs in a
process of its own), as a folder in /dev/shm. Sampled log-probs are
checked against the base with the adapter merged in Hugging Face names (runtime.models.peft_format)
and scored by the trainer's code, within the tolerance tests/test_gpu_vllm.py uses; a version
written in place is checked against vLLM's own build and activation of it, slot for slot.
"""

from __future__ import annotations

import typing

import pytest
import torch
from gpu_models import SMALL, free_gpu_memory, peaked_weights, random_prompts
from test_gpu_vllm import (
    MAX_NEW,
    T,
    _assert_matches,
    _assert_not_degenerate,
    _mismatch,
    small_engine,
)

from recipes.run_sections import Lora
from runtime.backends.fsdp_reference import GPUReference
from runtime.backends.vllm_lora import MAX_LORA_RANKS
from runtime.models import from_hf, to_hf
from runtime.models.export import write_hf_model
from runtime.models.peft_format import (
    adapter_config,
    adapter_layout,
    merge,
    pairs,
    write_adapter_folder,
)
from runtime.tasks.arith import tokenizer as char_tokenizer

pytestmark = pytest.mark.gpu

LORA = Lora(rank=16, alpha=32)


@pytest.fixture(scope="module")
def w0():
    return peaked_weights(SMALL, seed=10)


def write_base(w0, folder):
    """The base as a Hugging Face folder, which the engines load themselves."""
    return write_hf_model(
        to_hf(w0, SMALL),
        SMALL,
        folder / "model",
        tokenizer=char_tokenizer(SMALL.vocab_size),
        temperature=T,
    )


@pytest.fixture(scope="module")
def base(w0, tmp_path_factory):
    return write_base(w0, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def engine(base):
    gen = small_engine(model_dir=base, lora=LORA)
    print(f"vLLM engine with LoRA ready in {gen.init_seconds:.1f} s")
    yield gen
    gen.close()
    assert not gen.slots.root.exists()
    free_gpu_memory()


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """A version as the trainer publishes it on a GPU: bf16, on the device. B is nonzero and the
    scale makes B A comparable to the base's weights, so the adapter moves the log-probs."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=g) * 0.05).to("cuda", torch.bfloat16)
        for name, shape in adapter_layout(SMALL, LORA).items()
    }


def merged(w0, tensors) -> dict[str, torch.Tensor]:
    """TorchTitan-named fp32 weights of the base with `tensors` merged in HF names."""
    hf = {k: v.float().cpu() for k, v in to_hf(w0, SMALL).items()}
    out = merge(hf, pairs({k: v.cpu() for k, v in tensors.items()}), LORA.scaling)
    return {k: v.to("cuda") for k, v in from_hf(out, SMALL).items()}


def scorer(weights):
    return GPUReference(SMALL, temperature=T, weights=weights, device="cuda")


def test_the_ranks_an_engine_is_built_for_are_vllms():
    from vllm.config.lora import MaxLoRARanks

    assert typing.get_args(MaxLoRARanks) == MAX_LORA_RANKS


def _samples_are(engine, w0, tensors, others, seed):
    """The engine's samples are `tensors`'s merged model's, and none of `others`'s."""
    prompts = random_prompts(8, SMALL.vocab_size, seed=seed)
    out = engine.generate(prompts, n=4, max_new_tokens=MAX_NEW, temperature=T, seed=seed + 2)
    _assert_not_degenerate(out)
    weights = merged(w0, tensors)
    right = _assert_matches(out, weights, scorer(weights))
    for name, other in others.items():
        wrong = _mismatch(out, scorer(other))
        print(f"against {name} {wrong.mean():.3f}")
        assert wrong.mean() > 5 * right.mean()


def _times(slots) -> str:
    return ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in slots.timings.items())


def test_the_first_version_goes_in_from_memory_the_next_into_its_slot(engine, w0):
    """TP=1 in this process: the first version's tensors go to vLLM's LoRA manager as they are
    (no folder is written), the next is written over it in its GPU slot under the same id and a
    new name, and the samples are the merged model's."""
    slots, core = engine.slots, engine.llm.llm_engine
    assert slots.from_memory is not None and slots.in_place is not None
    versions = {v: adapter(seed=v) for v in (0, 1)}
    engine.incoming_version = 0
    engine.load_weights(versions[0])
    assert core.list_loras() == {1} and set(slots.timings) == {"build_s", "activate_s"}
    print(f"version 0 built and activated in {engine.load_seconds * 1e3:.1f} ms ({_times(slots)})")
    engine.incoming_version = 1
    engine.load_weights(versions[1])
    print(f"version 1 written in place in {engine.load_seconds * 1e3:.1f} ms ({_times(slots)})")
    assert not slots.root.exists()  # nothing written
    assert set(slots.timings) == {"plan_s", "write_s"}
    assert core.list_loras() == {1}
    assert (slots.current.lora_name, slots.current.lora_int_id) == ("policy-v1", 1)
    # what was handed over is untouched (vLLM's copy is scaled, not the sender's memory)
    assert all(torch.equal(v, adapter(seed=1)[k]) for k, v in versions[1].items())
    _samples_are(
        engine,
        w0,
        versions[1],
        {"the base alone": w0, "version 0": merged(w0, versions[0])},
        seed=1,
    )


def _slot_differences(worker, lora_id: int, twin_id: int) -> list[str]:
    """Runs in vLLM's worker: the LoRA layers whose slot of adapter `lora_id` differs from that
    of `twin_id` in any slice's A or B."""
    manager = worker.model_runner.lora_manager._adapter_manager
    mine, twin = (manager.lora_index_to_id.index(i) for i in (lora_id, twin_id))
    differ = []
    for name, layer in manager.modules.items():
        # a tuple of slices (linear layers), one tensor (the embedding, the logits processor)
        stacked = [
            t
            for held in (layer.lora_a_stacked, layer.lora_b_stacked)
            for t in (held if isinstance(held, tuple) else (held,))
        ]
        if any(not torch.equal(t[mine], t[twin]) for t in stacked):
            differ.append(name)
    return differ


def _greedy(engine, request, seed: int) -> list[list[int]]:
    slot, engine.slots.current = engine.slots.current, request
    try:
        prompts = random_prompts(16, SMALL.vocab_size, seed=seed)
        out = engine.generate(prompts, n=1, max_new_tokens=MAX_NEW, temperature=0, logprobs=False)
    finally:
        engine.slots.current = slot
    return [c.response_ids for c in out]


def _same_sequences(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def test_a_version_in_place_is_vllms_own_build_and_activation_of_it(engine):
    """A version written into its slot leaves there what vLLM's own add and activate of the same
    version put into the other slot, to the bit; greedy decoding gives the same sequences under
    either (all but near-ties), and other sequences than the version before it (built by vLLM
    beside it)."""
    from vllm.lora.request import LoRARequest

    slots, core = engine.slots, engine.llm.llm_engine
    previous, tensors = adapter(seed=19), adapter(seed=20)
    for version in (previous, tensors):
        engine.incoming_version = slots.next_version()
        engine.load_weights(version)
    assert "write_s" in slots.timings  # the second went in place
    print(f"a version written in place in {engine.load_seconds * 1e3:.2f} ms ({_times(slots)})")
    lora_id = slots.lora_id
    assert core.list_loras() == {lora_id}

    def beside(twin_id: int, version: dict[str, torch.Tensor]) -> LoRARequest:
        engine._adapter_from_memory(twin_id, version, adapter_config(LORA, None))
        return LoRARequest(f"vllm-built-{twin_id}", twin_id, str(slots.folder(twin_id)))

    try:
        twin = beside(1000, tensors)
        differ = engine.llm.collective_rpc(_slot_differences, args=(lora_id, 1000))[0]
        assert not differ, differ[:4]
        # The slots' bits are the exact check. Greedy decoding is a loose one: the LoRA
        # kernels' sums may differ by slot in their last bits, so a near-tie can go the other
        # way (on an H200 the 7th of 16 sequences parted from its twin partway through):
        # most sequences agree in full, and far fewer agree with the version before.
        greedy = _greedy(engine, slots.current, seed=6)
        same = _same_sequences(greedy, _greedy(engine, twin, seed=6))
        core.remove_lora(1000)
        before = _same_sequences(greedy, _greedy(engine, beside(1001, previous), seed=6))
        print(
            f"greedy sequences equal: {same}/16 under the twin, {before}/16 under the version before"
        )
        assert same >= 12 and before <= 8
    finally:
        for twin_id in (1000, 1001):
            core.remove_lora(twin_id)
    assert core.list_loras() == {lora_id}


def test_a_version_from_a_folder_as_an_engine_of_its_own_process_takes_it(engine, w0):
    """The path for an engine whose workers are other processes (TP>1): a PEFT folder in
    /dev/shm that vLLM's add_lora reads."""
    slots, core = engine.slots, engine.llm.llm_engine
    from_memory, slots.from_memory = slots.from_memory, None
    in_place, slots.in_place = slots.in_place, None
    try:
        version = slots.next_version()
        tensors = adapter(seed=2)
        engine.incoming_version = version
        engine.load_weights(tensors)
        print(f"adapter version loaded from a folder in {engine.load_seconds * 1e3:.1f} ms")
        assert sorted(p.name for p in slots.folder(version).iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        assert core.list_loras() == {version + 1}
        _samples_are(engine, w0, tensors, {"the base alone": w0}, seed=4)
    finally:
        slots.from_memory, slots.in_place = from_memory, in_place


def test_an_engine_of_its_own_process_takes_each_version_from_a_folder(base, w0):
    """`generator.engine separate`: the worker is another process, so versions go in as PEFT
    folders in /dev/shm (never from memory) through vLLM's add_lora, which crosses into the
    engine's process; its samples are the merged model's, and the next version replaces the
    one before."""
    gen = small_engine(model_dir=base, lora=LORA, engine_in_process=False)
    print(f"vLLM engine of its own process with LoRA ready in {gen.init_seconds:.1f} s")
    try:
        slots, core = gen.slots, gen.llm.llm_engine
        assert slots.from_memory is None and gen.ipc_opens == 1
        versions = {v: adapter(seed=10 + v) for v in (0, 1)}
        for v, tensors in versions.items():
            gen.incoming_version = v
            gen.load_weights(tensors)
            print(
                f"adapter version {v} into the separate engine in {gen.load_seconds * 1e3:.1f} ms"
            )
            assert set(core.list_loras()) == {v + 1} and slots.current.lora_name == f"policy-v{v}"
        assert sorted(p.name for p in slots.root.iterdir()) == ["v1"]  # v0's folder went with it
        _samples_are(
            gen,
            w0,
            versions[1],
            {"the base alone": w0, "version 0": merged(w0, versions[0])},
            seed=6,
        )
    finally:
        gen.close()
        free_gpu_memory()
    assert not gen.slots.root.exists()


def test_an_exported_adapter_folder_serves_the_same_policy(engine, w0, tmp_path):
    """What `forgesky export` writes of a LoRA run (fp32, with forgesky.json) is an adapter vLLM
    serves from its path: its samples are the merged model's, as a version's are. (Greedy
    tokens are not compared: LoRA kernels need not give bit-equal logits from one call to the
    next, and one near-tie changes the rest of a sequence.)"""
    from vllm.lora.request import LoRARequest

    tensors = adapter(seed=7)
    folder = write_adapter_folder(
        tmp_path / "adapter",
        {k: v.float() for k, v in tensors.items()},
        LORA,
        None,
        {"name": "made-up"},
        {"step": 7},
    )
    slot = engine.slots.current
    engine.slots.current = LoRARequest("exported", 1000, str(folder))
    try:
        prompts = random_prompts(8, SMALL.vocab_size, seed=2)
        out = engine.generate(prompts, n=4, max_new_tokens=MAX_NEW, temperature=T, seed=5)
    finally:
        engine.slots.current = slot
    _assert_not_degenerate(out)
    weights = merged(w0, tensors)
    right = _assert_matches(out, weights, scorer(weights))
    assert _mismatch(out, scorer(w0)).mean() > 5 * right.mean()


_KERNEL_OPTIONS_CASE = """
import sys
from pathlib import Path

sys.path.insert(0, {tests!r})
import test_gpu_lora as t

w0 = t.peaked_weights(t.SMALL, seed=10)
base = t.write_base(w0, Path({folder!r}))
gen = t.small_engine(
    model_dir=base, lora=t.LORA, lora_dual_stream=True, lora_specialize_active=True
)
import vllm.lora.layers.base_linear as layers

assert hasattr(layers, "lora_linear_async"), "the two-stream LoRA layers were not built"
lora_config = gen.llm.llm_engine.vllm_config.lora_config
assert lora_config.specialize_active_lora, "specialize_active_lora did not reach the engine"
t.test_the_first_version_goes_in_from_memory_the_next_into_its_slot(gen, w0)
gen.close()
print("kernel options: the merged model's samples")
"""


def test_vllms_lora_kernel_options_sample_the_same_policy(tmp_path):
    """generator.lora_dual_stream and lora_specialize_active on (vLLM reads the first once a
    process, so in a process of its own): the first version from memory, the next in its slot,
    and the samples are still the merged model's."""
    import subprocess
    import sys
    from pathlib import Path

    free_gpu_memory()
    code = _KERNEL_OPTIONS_CASE.format(tests=str(Path(__file__).parent), folder=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(done.stdout[-4000:], done.stderr[-4000:])
    assert done.returncode == 0 and "the merged model's samples" in done.stdout
