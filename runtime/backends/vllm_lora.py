"""The policy as a vLLM LoRA adapter: each version is registered with the engine, which samples
with it while the base weights stay where they are.

Version v is `LoRARequest("policy-v<v>", v + 1, path)`, added eagerly: the load happens in the
weight update, which times it, not in the first generation after it. With the engine's worker in
this process (TP=1, the engine core in this process) the adapter goes in from memory, the tensors
handed straight to the worker's LoRA manager (runtime.backends.vllm_worker.add_adapter_on_worker);
otherwise (TP>1, or an engine core of its own process) vLLM's public `add_lora` reads it from a
path, so it is first written as a PEFT folder in shared memory,
`/dev/shm/forgesky-lora-<pid>-<n>/v<v>/` (runtime.models.peft_format; n counts the engines this
process made). The previous version is then removed (and its folder deleted). Two slots
(`max_loras=2`) let v load while v-1 is still registered. vLLM keys its prefix cache on the
adapter's name, new with every version, so no cache reset is needed.
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


def engine_options(lora: Any) -> dict[str, Any]:
    """The engine arguments that let it serve `lora` (a recipe's `model.lora`)."""
    return {
        "enable_lora": True,
        "max_lora_rank": max_lora_rank(lora.rank),
        "max_loras": MAX_LORAS,
        "max_cpu_loras": MAX_LORAS,
    }


def _vllm_request(*args: Any) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(*args)


class LoraSlots:
    """The adapter versions registered with one engine (`engine`: vLLM's `LLMEngine`, which has
    `add_lora` and `remove_lora`); `current` is the request every generation passes.

    `request_type` builds a request from (name, id, path): vLLM's `LoRARequest` unless given.
    `from_memory(id, tensors, adapter_config)`, where given, registers a version from its
    tensors (no folder is written) and returns the seconds its parts took.
    """

    def __init__(
        self,
        engine: Any,
        lora: Any,
        root: str | Path | None = None,
        request_type: Callable[..., Any] = _vllm_request,
        from_memory: Callable[[int, Mapping[str, Tensor], dict[str, Any]], dict[str, float]]
        | None = None,
    ):
        self.engine, self.lora = engine, lora
        shm = Path("/dev/shm")
        parent = shm if shm.is_dir() else Path(tempfile.gettempdir())
        own = f"forgesky-lora-{os.getpid()}-{next(_ENGINES)}"  # two engines, two folders
        self.root = Path(root) if root is not None else parent / own
        self.request_type = request_type
        self.from_memory = from_memory
        self.timings: dict[str, float] = {}
        self.current: Any = None
        self.version: int | None = None

    def folder(self, version: int) -> Path:
        """Where version `version` is written."""
        return self.root / f"v{version}"

    def request(self, version: int) -> Any:
        """The request that names version `version` (vLLM's ids start at 1)."""
        return self.request_type(f"policy-v{version}", version + 1, str(self.folder(version)))

    def load(self, version: int, tensors: Mapping[str, Tensor]) -> Any:
        """Register version `version` (PEFT names, any device, views included), then drop the
        one before; returns its request."""
        if self.version is not None and version <= self.version:
            # an id vLLM has seen keeps its first adapter: the new one would never be read
            raise ValueError(f"adapter version {version} after version {self.version}")
        request = self.request(version)
        if self.from_memory is not None:
            self.timings = self.from_memory(version + 1, tensors, adapter_config(self.lora, None))
        else:
            write_adapter_folder(self.folder(version), tensors, self.lora, None)
            if not self.engine.add_lora(request):
                raise RuntimeError(f"vLLM did not add the adapter of policy version {version}")
        previous = self.version
        self.current, self.version = request, version
        if previous is not None:
            self.engine.remove_lora(previous + 1)
            shutil.rmtree(self.folder(previous), ignore_errors=True)
        return request

    def next_version(self) -> int:
        """The version after the current one (0 before any)."""
        return 0 if self.version is None else self.version + 1

    def close(self) -> None:
        """Delete every adapter folder (the engine goes with its own shutdown)."""
        shutil.rmtree(self.root, ignore_errors=True)
