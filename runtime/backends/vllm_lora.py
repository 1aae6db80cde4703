"""The policy as a vLLM LoRA adapter: each version is registered with the engine, which samples
with it while the base weights stay where they are.

Version v is `LoRARequest("policy-v<v>", id, path)`, loaded eagerly: the load happens in the
weight update, which times it, not in the first generation after it. How it loads:
- TP=1, the engine's worker in this process, and an adapter already in a GPU slot: written in
  place into that slot and into vLLM's registered copy of the adapter
  (runtime.backends.vllm_lora_slot: a few multi-tensor copies, what vLLM's own build and
  activation would put there), under the id of the adapter it replaces;
- otherwise (the first version, or one the slot cannot take as it is: the reason is said on
  stderr) with TP=1 from memory, the tensors handed to the worker's LoRA manager to build and
  activate (runtime.backends.vllm_worker.add_adapter_on_worker) under the id v + 1;
- with TP>1, or an engine core of its own process, through vLLM's public `add_lora`, which
  reads a path: the version is first written as a PEFT folder in shared memory,
  `/dev/shm/forgesky-lora-<pid>-<n>/v<v>/` (runtime.models.peft_format; n counts the engines
  this process made), under the id v + 1.
A version under a new id removes the one before (and its folder); two slots (`max_loras=2`) let
it load while the one before is still registered. vLLM keys its prefix cache on the adapter's
name (`_gen_lora_extra_hash_keys` in vllm/v1/core/kv_cache_utils.py), new with every version
(the id may stay), so no cache reset is needed. A version loads
between generations (the generator actor's endpoints run one at a time), so no completion mixes
two versions, in place or not.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from runtime.models.peft_format import adapter_config, write_adapter_folder

# vLLM 0.24's `vllm.config.lora.MaxLoRARanks`: the ranks an engine can be built for.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# v loads while v-1 is still registered (the GPU slots and the host cache alike).
MAX_LORAS = 2
_ENGINES = itertools.count()


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM can be built for that holds an adapter of `rank`."""
    for allowed in MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {MAX_LORA_RANKS[-1]}, not {rank}")


def engine_options(lora: Any, *, specialize_active: bool = False) -> dict[str, Any]:
    """The engine arguments that let it serve `lora` (a recipe's `model.lora`);
    `specialize_active` (the recipe's generator.lora_specialize_active) adds vLLM's
    `specialize_active_lora`."""
    options: dict[str, Any] = {
        "enable_lora": True,
        "max_lora_rank": max_lora_rank(lora.rank),
        "max_loras": MAX_LORAS,
        "max_cpu_loras": MAX_LORAS,
    }
    if specialize_active:
        options["specialize_active_lora"] = True
    return options


def _vllm_request(*args: Any) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(*args)


class LoraSlots:
    """The adapter versions registered with one engine (`engine`: vLLM's `LLMEngine`, which has
    `add_lora` and `remove_lora`); `current` is the request every generation passes.

    `request_type` builds a request from (name, id, path): vLLM's `LoRARequest` unless given.
    `from_memory(id, tensors, adapter_config)`, where given, registers a version from its
    tensors (no folder is written) and returns the seconds its parts took. `in_place(id,
    tensors, adapter_config)`, where given, writes a version over the adapter registered as
    `id` and returns the seconds its parts took, or None where it cannot (the version is then
    registered under an id of its own).
    """

    def __init__(
        self,
        engine: Any,
        lora: Any,
        root: str | Path | None = None,
        request_type: Callable[..., Any] = _vllm_request,
        from_memory: Callable[[int, Mapping[str, Tensor], dict[str, Any]], dict[str, float]]
        | None = None,
        in_place: Callable[[int, Mapping[str, Tensor], dict[str, Any]], dict[str, float] | None]
        | None = None,
    ):
        self.engine, self.lora = engine, lora
        shm = Path("/dev/shm")
        parent = shm if shm.is_dir() else Path(tempfile.gettempdir())
        own = f"forgesky-lora-{os.getpid()}-{next(_ENGINES)}"  # two engines, two folders
        self.root = Path(root) if root is not None else parent / own
        self.request_type = request_type
        self.from_memory = from_memory
        self.in_place = in_place
        self.timings: dict[str, float] = {}
        self.current: Any = None
        self.version: int | None = None
        self.lora_id: int | None = None  # vLLM's id of the adapter `current` names

    def folder(self, version: int) -> Path:
        """Where version `version` is written."""
        return self.root / f"v{version}"

    def request(self, version: int, lora_id: int | None = None) -> Any:
        """The request that names version `version`, under vLLM's id `lora_id` (by default its
        own, version + 1: vLLM's ids start at 1)."""
        lora_id = version + 1 if lora_id is None else lora_id
        return self.request_type(f"policy-v{version}", lora_id, str(self.folder(version)))

    def load(self, version: int, tensors: Mapping[str, Tensor]) -> Any:
        """Register version `version` (PEFT names, any device, views included), in place of the
        one before where `in_place` can, else under an id of its own, then dropping the one
        before; returns its request."""
        if self.version is not None and version <= self.version:
            # an id vLLM has seen keeps its first adapter: the new one would never be read
            raise ValueError(f"adapter version {version} after version {self.version}")
        if self.in_place is not None and self.lora_id is not None:
            timings = self.in_place(self.lora_id, tensors, adapter_config(self.lora, None))
            if timings is not None:
                self.timings = timings
                self.current, self.version = self.request(version, self.lora_id), version
                return self.current
        request = self.request(version)
        if self.from_memory is not None:
            self.timings = self.from_memory(version + 1, tensors, adapter_config(self.lora, None))
        else:
            write_adapter_folder(self.folder(version), tensors, self.lora, None)
            if not self.engine.add_lora(request):
                raise RuntimeError(f"vLLM did not add the adapter of policy version {version}")
        previous, previous_id = self.version, self.lora_id
        self.current, self.version, self.lora_id = request, version, version + 1
        if previous_id is not None:
            self.engine.remove_lora(previous_id)
        if previous is not None:
            shutil.rmtree(self.folder(previous), ignore_errors=True)
        return request

    def next_version(self) -> int:
        """The version after the current one (0 before any)."""
        return 0 if self.version is None else self.version + 1

    def close(self) -> None:
        """Delete every adapter folder (the engine goes with its own shutdown)."""
        shutil.rmtree(self.root, ignore_errors=True)
