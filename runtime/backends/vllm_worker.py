"""What runs inside a vLLM worker process through `collective_rpc`: loading a policy version into
the model the engine executes, and proving it arrived there; registering a LoRA version with
vLLM's LoRA manager, and planning where later versions go in its GPU slot
(runtime.backends.vllm_lora_slot).

With the engine core in the generator's process the worker is that process (TP=1) or workers it
started (TP>1), and these module-level functions are handed to `collective_rpc` themselves
(vLLM's multiprocess executor pickles them by name for workers started with spawn). An engine
core in a process of its own takes no function: its client sends each call as msgpack, which
carries plain values only (a function, or any object msgpack does not know, needs
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`, which lets pickle run on whatever arrives; a tensor
arrives as its dtype and shape, its bytes left behind). There `WorkerExtension`, which vLLM mixes
into its worker class (`worker_extension_cls`), has the same loads as methods called by name with
plain arguments: a file's path, or CUDA IPC handles in their plain form
(`runtime.weights.ipc.plain_handle`) with the flat layout as lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

# Replicated on every TP rank and stored unfused under its HF name: read back after each load.
PROBE = "model.norm.weight"


def load_on_worker(worker: Any, weights: Mapping[str, Tensor] | str) -> list[str]:
    """Runs inside a vLLM worker: load HF-named weights (a dict, or a safetensors path) into its
    model; returns the model parameters that got no weight.

    `loaded` only says which names the loaders matched; the probe parameter, read back from the
    model the runner executes, proves the bytes arrived there (a load into a copy, or one that
    matched names but wrote nothing, would otherwise pass silently).
    """
    model = worker.get_model()
    params = dict(model.named_parameters())
    with torch.no_grad():
        if isinstance(weights, str):
            from safetensors import safe_open

            with safe_open(weights, framework="pt", device="cpu") as f:
                loaded = model.load_weights((k, f.get_tensor(k)) for k in f.keys())  # noqa: SIM118
                probe = f.get_tensor(PROBE) if PROBE in f.keys() else None  # noqa: SIM118
        else:
            loaded = model.load_weights(iter(weights.items()))
            probe = weights.get(PROBE)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    missing = sorted(set(params) - set(loaded or ()))
    if not missing and probe is not None and PROBE in params:
        live = params[PROBE]
        expected = probe.to(device=live.device, dtype=live.dtype)
        if not torch.isfinite(expected).all():  # NaN never equals itself: say what it is
            raise RuntimeError(
                f"the weights just loaded hold NaN or infinite values ({PROBE}): the "
                "policy version sent was not finite"
            )
        if not torch.equal(live.detach(), expected):
            raise RuntimeError(
                f"vLLM's {PROBE} differs from the weight just loaded: load_weights did not "
                "reach the model the engine runs"
            )
    return missing


def load_flat_on_worker(
    worker: Any, handles: Sequence[Any], entries: Mapping[str, tuple[Any, ...]]
) -> list[str]:
    """Runs inside a vLLM worker: open a flat weight buffer by the CUDA IPC handle meant for
    this worker's TP rank (see `runtime.weights.ipc.export_ipc`; either form `open_ipc` takes)
    and load from views of it."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from runtime.weights.flat import views
    from runtime.weights.ipc import open_ipc
    from runtime.weights.layout import TensorEntry

    flat = open_ipc(handles[get_tensor_model_parallel_rank()])
    tensors = views(flat, {name: TensorEntry(*e) for name, e in entries.items()})
    try:
        return load_on_worker(worker, tensors)
    finally:
        del tensors, flat  # the mapping closes with the last reference


class WorkerExtension:
    """The loads an engine core of its own process runs, as methods of vLLM's worker (the
    engine's `worker_extension_cls`, so `collective_rpc` calls them by name; `self` is the
    worker). Every argument is a plain value; each returns the parameters that got no weight."""

    def forgesky_load_file(self, path: str) -> list[str]:
        """Load the HF-named weights of a safetensors file (in /dev/shm: the host's memory)."""
        return load_on_worker(self, path)

    def forgesky_load_ipc(
        self, handles: Sequence[Mapping[str, Any]], entries: Mapping[str, Sequence[Any]]
    ) -> list[str]:
        """Load from a flat buffer of another process: `handles` one plain CUDA IPC handle for
        each TP rank, `entries` the layout (name -> `TensorEntry` fields)."""
        return load_flat_on_worker(self, handles, entries)


def add_adapter_on_worker(
    worker: Any, lora_id: int, tensors: Mapping[str, Tensor], config: Mapping[str, Any]
) -> dict[str, float]:
    """Runs inside a vLLM worker of this process (TP=1): register a LoRA adapter from tensors in
    memory (PEFT names, `config` its adapter_config.json) under `lora_id` and put it in a GPU
    slot, the steps of vLLM's own `add_lora` without the folder it reads from. Returns the
    seconds of building it (vLLM's `LoRAModel`) and of copying it into the slot.

    vLLM folds the scale into B in place: it gets copies, never the sender's memory (a CUDA IPC
    view of the trainer's buffer)."""
    import time

    from vllm.lora.peft_helper import PEFTHelper

    start = time.perf_counter()
    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    if lora_id in adapters.list_adapters():
        raise ValueError(f"vLLM already holds an adapter numbered {lora_id}")
    helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    helper.validate_legal(manager.lora_config)
    names = list(tensors)
    with torch.no_grad():
        own = torch._foreach_mul([tensors[n] for n in names], 1.0)
        copies = dict(zip(names, own, strict=True))
    model = adapters.model
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=copies,
        peft_helper=helper,
        device=str(manager.device),
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=getattr(model, "hf_to_vllm_mapper", None),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    if len(adapters) + 1 > adapters.capacity:
        adapters.remove_oldest_adapter()
    adapters.add_adapter(lora)
    built = time.perf_counter()
    adapters.activate_adapter(lora_id)
    torch.cuda.synchronize()
    return {"build_s": built - start, "activate_s": time.perf_counter() - built}


def plan_slot_on_worker(
    worker: Any, lora_id: int, tensors: Mapping[str, Tensor], config: Mapping[str, Any]
) -> Any:
    """Runs inside a vLLM worker of this process (TP=1): where each matrix of a version goes
    in the GPU slot of the adapter `lora_id` and in vLLM's registered copy of it
    (runtime.backends.vllm_lora_slot.SlotWrite), read off vLLM's own LoRA manager: its layers,
    packed modules and slot table, its parsing of PEFT names and its scale."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    from runtime.backends.vllm_lora_slot import NotInPlace, plan_slot

    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    lora = adapters.get_adapter(lora_id)
    if lora is None or lora_id not in adapters.lora_index_to_id:
        raise NotInPlace(f"vLLM holds no adapter numbered {lora_id} in a GPU slot")
    helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    return plan_slot(
        lora_id=lora_id,
        slot=adapters.lora_index_to_id.index(lora_id),
        layers=adapters.modules,
        packed=adapters.packed_modules,
        adapter=lora.loras,
        where={name: parse_fine_tuned_lora_name(name, mapper) for name in tensors},
        tensors=tensors,
        scale=helper.vllm_lora_scaling_factor,
        config=dict(config),
    )
