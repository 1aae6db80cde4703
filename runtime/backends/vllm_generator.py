"""GPU generator: a vLLM engine whose weights are updated in place, its engine core in the
generator actor's process or in a process of its own (the recipe's `generator.engine`).

- `in-process` (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the default): the engine core, and with TP=1
  the worker, run in this process, so the model object is reachable through `collective_rpc`
  without pickling, and a weight update is a `model.load_weights(iter((hf_name, tensor), ...))`
  straight into the parameters vLLM already allocated (CUDA graphs and compiled code keep
  pointing at the same storage). Its cost: vLLM's engine loop (scheduling, preparing inputs,
  processing outputs: CPU work that runs for the whole of a generate call) shares this process's
  GIL with the actor's own threads (Monarch's, asyncio's, TorchStore's, the push receiver's).
- `separate` (vLLM's own default): the engine core, and with TP=1 the worker, run in a process
  vLLM starts, which this one talks to over ZMQ in msgpack; its loop has a GIL of its own. Its
  costs: one more process and CUDA context on the generator's first GPU (not in the memory
  plan), each request and output serialised across the boundary, and weight loads that cross it
  as plain values only (runtime.backends.vllm_worker says why): a version in a flat GPU buffer
  (the ipc and push paths) goes as CUDA IPC handles that the engine's workers open, still no
  copy through the host; host tensors (the store path) as one safetensors file in /dev/shm; a
  LoRA version as a PEFT folder in /dev/shm (`runtime.backends.vllm_lora`), never from memory.
  The worker runs `runtime.backends.vllm_worker.WorkerExtension`'s methods, called by name.
  vLLM 0.24's weight-transfer API (`init_weight_transfer_engine`, `update_weights`) is not the
  route: its IPC backend imports ray, which this stack does not install, and its updates carry
  torch's rebuild arguments (classes, a dtype), which cross into the engine's process only with
  `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (pickle on whatever arrives); its NCCL backend makes the
  trainer a rank of a process group of vLLM's, which the push path already does its own way,
  into a buffer here, and which the ipc and store paths have no use for.

Start-up needs no Hub: the engine is built from a folder holding only the `config.json` of the
recipe's architecture, with `load_format="dummy"` (random weights), and `skip_tokenizer_init`
(prompts arrive as token ids; the actor decodes with its own tokenizer). Real weights arrive as
policy version 0 from the trainer, like every later version.

Tensor parallelism: with TP=1 the worker is the engine core's process (vLLM's uni-process
executor). With TP>1 vLLM's multiprocess executor starts one worker process per GPU, and each
worker's weight loaders keep their own shard of whatever full tensors they are given:
- `load_flat` and `load_ipc` (the direct weight paths of `runtime.weights.transport`): the
  version sits in one flat buffer on this proc's first GPU (pushed there: `load_flat`) or on the
  trainer's (`load_ipc`, with one CUDA IPC handle for each worker); every worker opens the buffer
  through its own handle and loads from views of it, worker 0 from its own GPU, the others over
  NVLink/PCIe peer reads. No copy through the host. Each handle is opened by one process only
  (runtime/weights/ipc.py says why). The same holds for a separate engine's worker with TP=1.
- `load_weights` with TP>1, or into a separate engine (the TorchStore path: tensors on the
  host): the state dict is written once to a safetensors file in /dev/shm and every worker
  reads it.

Log-probs (see `runtime.backends.base`): the contract is `log softmax(logits / T)[token]`, with
no top-p renormalisation. vLLM's `logprobs_mode` is engine-wide:
- "raw_logprobs" is `log softmax(logits)` before temperature, top-k/top-p: exact when T = 1;
- "processed_logprobs" is after temperature *and* top-k/top-p: exact when top_p = 1 (the
  nucleus mask would renormalise otherwise).
So T = 1 uses raw, top_p = 1 uses processed, and T != 1 with top_p < 1 has no exact mode and is
refused (`logprobs_mode_for`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recipes import UserError
from runtime.backends.base import Completion
from runtime.backends.vllm_worker import WorkerExtension, load_flat_on_worker, load_on_worker
from runtime.models import ModelSpec, hf_config
from runtime.models.peft_format import adapter_only, check_adapter
from runtime.procs.gpu_check import engine_room_explained

_SHM = Path("/dev/shm")


def logprobs_mode_for(temperature: float, top_p: float) -> str:
    """The vLLM `logprobs_mode` whose sampled-token log-probs equal `log softmax(logits / T)`."""
    if temperature <= 0:
        raise UserError(f"grpo.temperature must be > 0 for GRPO sampling (got {temperature})")
    if temperature == 1.0:
        return "raw_logprobs"
    if top_p >= 1.0:
        return "processed_logprobs"
    raise UserError(
        f"grpo.temperature={temperature} with grpo.top_p={top_p}: vLLM reports log-probs either "
        "before temperature or after the top-p renormalisation, neither of which the trainer "
        "recomputes; set grpo.top_p=1.0 or grpo.temperature=1.0"
    )


def engine_environment(
    top_p: float, *, engine_in_process: bool = True, lora_dual_stream: bool = False
) -> dict[str, str | None]:
    """What vLLM reads from the environment when an engine is created (None: unset, vLLM's default).

    `VLLM_ENABLE_V1_MULTIPROCESSING`: the engine core in this process unless `engine_in_process`
    is False. `VLLM_USE_FLASHINFER_SAMPLER`: off at top-p 1.0. The generator's requests never set
    top-k, so at top-p 1.0 vLLM samples on its PyTorch path and FlashInfer's top-k/top-p sampler
    would run only in the engine's warm-up (one sampler call with both set), which first builds
    FlashInfer's sampling kernels on a machine that has not built them. Below 1.0 it samples for
    real and vLLM's default stands. `VLLM_LORA_ENABLE_DUAL_STREAM`: the recipe's
    generator.lora_dual_stream (unset: vLLM's default, off).
    """
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if engine_in_process else "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0" if top_p >= 1.0 else None,
        DUAL_STREAM: "1" if lora_dual_stream else None,
    }


DUAL_STREAM = "VLLM_LORA_ENABLE_DUAL_STREAM"
# vLLM reads DUAL_STREAM once a process, when its LoRA layers' module (below) is first imported:
# it registers the op its two-stream layers call only then
_LORA_LINEAR = "vllm.lora.layers.base_linear"


def dual_stream_unreadable(wanted: bool, modules: Mapping[str, Any]) -> str | None:
    """Why vLLM would not take `generator.lora_dual_stream` as asked in this process, or None:
    its LoRA layers' module was imported before with the other setting (an engine built here
    before), and the op a two-stream layer calls exists only where it was on then."""
    module = modules.get(_LORA_LINEAR)
    if module is None or hasattr(module, "lora_linear_async") == wanted:
        return None
    return (
        f"generator.lora_dual_stream={str(wanted).lower()}: vLLM's LoRA layers were imported "
        f"in this process with it {'off' if wanted else 'on'} (an engine built here before), "
        "and vLLM reads it once; start the generator in a process of its own"
    )


def custom_all_reduce_allowed(tensor_parallel_size: int, environ: Mapping[str, str]) -> bool:
    """Whether vLLM's custom all-reduce can run for this engine's TP workers.

    It shares the buffers of its CUDA graphs between the TP workers by `cudaIpcGetMemHandle`,
    which refuses memory of PyTorch's expandable segments (CUDA virtual memory), and the worker
    then exits during graph capture ("custom_all_reduce.cuh:455 'invalid argument'", vLLM issue
    42609). The runtime gives a generator that shares its GPUs expandable segments, so there the
    engine all-reduces through NCCL; with TP=1 there is no all-reduce.
    """
    if tensor_parallel_size <= 1:
        return True
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in environ.get(name, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return False
    return True


def _write_weights(
    folder: Path, weights: Mapping[str, Tensor], spec: ModelSpec, dtype: torch.dtype
) -> None:
    """HF-named `weights` as `folder/model.safetensors` in `dtype` (a tied output projection
    left out, as Hugging Face writes it)."""
    from safetensors.torch import save_file

    tied = {"lm_head.weight"} if spec.tie_embeddings else set()
    save_file(
        {k: v.detach().to("cpu", dtype).contiguous() for k, v in weights.items() if k not in tied},
        str(folder / "model.safetensors"),
    )


def write_model_dir(spec: ModelSpec, directory: str | Path, **token_ids: Any) -> Path:
    """A folder vLLM can start from: the architecture's `config.json` (no weights, no tokenizer).

    `token_ids` may set pad_token_id, bos_token_id, eos_token_id.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(spec, **token_ids)  # with `architectures`, which vLLM reads
    config.save_pretrained(str(directory))
    return directory


@contextlib.contextmanager
def _took(what: str, over_s: float = 5.0) -> Iterator[None]:
    """A line on stderr when `what` takes more than `over_s` seconds."""
    start = time.perf_counter()
    yield
    took = time.perf_counter() - start
    if took > over_s:
        print(f"vLLM generator: {what} took {took:.1f} s", file=sys.stderr, flush=True)


def _sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position logprobs container."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs; SamplingParams.logprobs must be set")
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:  # FlatLogprobs: the sampled token comes first at every position
        if len(starts) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(starts)} log-probs for {len(token_ids)} tokens")
        # Checked, not assumed: a top-k entry in that slot would pass every shape check.
        if any(logprobs.token_ids[s] != tok for s, tok in zip(starts, token_ids, strict=True)):
            raise RuntimeError("vLLM's first log-prob entry is not the sampled token")
        values = logprobs.logprobs
        return [float(values[s]) for s in starts]
    return [float(pos[tok].logprob) for tok, pos in zip(token_ids, logprobs, strict=True)]


def request_tokens(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, max_model_len: int
) -> list[int]:
    """The new tokens each prompt may have: `max_new_tokens`, or what its length leaves of the
    engine's `max_model_len` where that is less. An episode round batches contexts of different
    lengths under one `max_new_tokens` (the most any of them may still take; the episode loop
    cuts each turn to its own room): vLLM refuses a request past max_model_len."""
    most = []
    for p in prompts:
        left = max_model_len - len(p)
        if left < 1:
            raise ValueError(
                f"a prompt of {len(p)} tokens leaves no room in the engine's max_model_len "
                f"{max_model_len}"
            )
        most.append(min(max_new_tokens, left))
    return most


class VLLMGenerator:
    """Samples with vLLM; same interface as `HFGenerator` (see `GeneratorBackend`).

    `temperature` and `top_p` are fixed per engine because they choose vLLM's `logprobs_mode`;
    `generate` refuses other values. `max_model_len` bounds prompt + response tokens (it sizes
    the KV cache). `gpu_memory_utilization` is the share of the GPU's memory this engine may
    take (weights, activations, KV cache). When other processes share the GPU, give
    `kv_cache_memory_bytes` instead: vLLM then skips its memory profiling, which reads the
    device's free memory and would count the neighbours' allocations (or frees) made meanwhile
    as its own (and can fail on them); `gpu_memory_utilization` then only gates start-up (that
    much of the GPU must be free).
    `weights` (HF names) are loaded right after start; otherwise the engine holds random
    weights until the first `load_weights`. `enforce_eager` skips torch.compile and CUDA graphs
    (faster start, slower decode). The engine core runs in this process unless
    `engine_in_process` is False (the recipe's `generator.engine separate`): then in a process
    of its own, vLLM's default; every weight path loads into either (the module says how).
    With `lora` (a recipe's `model.lora`) the engine serves LoRA adapters: a version of the
    adapter alone (PEFT names) goes to `runtime.backends.vllm_lora.LoraSlots` under the number
    `incoming_version` gives (the actor sets it before each load), and every generation uses
    the newest (with TP=1 in this process from memory, every version after the first written
    into the first's GPU slot in place; else from a folder in /dev/shm); a version of base
    weights loads as without LoRA.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        max_model_len: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        dtype: torch.dtype = torch.bfloat16,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        weights: Mapping[str, Tensor] | None = None,
        enforce_eager: bool = False,
        max_num_seqs: int | None = None,
        model_dir: str | Path | None = None,
        engine_in_process: bool = True,
        lora: Any = None,
        lora_dual_stream: bool = False,
        lora_specialize_active: bool = False,
    ):
        if lora is not None and (why := dual_stream_unreadable(lora_dual_stream, sys.modules)):
            raise UserError(why)
        # Read by vLLM when the engine is created: `engine_environment`, and TP workers started
        # with spawn (fork after CUDA init is unsafe).
        environment = engine_environment(
            top_p, engine_in_process=engine_in_process, lora_dual_stream=lora_dual_stream
        )
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.engine_in_process = engine_in_process
        import vllm.envs
        from vllm import LLM

        # An engine core started in this process before (a test's) froze vLLM's reading of the
        # environment (`enable_envs_cache`): this engine reads it afresh.
        vllm.envs.disable_envs_cache()

        self.spec = spec
        self.temperature = temperature
        self.top_p = top_p
        self.logprobs_mode = logprobs_mode_for(temperature, top_p)
        self.tensor_parallel_size = tensor_parallel_size
        self.eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len
        self.policy_version = 0
        self.load_seconds = 0.0
        self.incoming_version: int | None = None
        self.slots: Any = None
        self._tmp = tempfile.TemporaryDirectory(prefix="forgesky-vllm-")
        folder = model_dir or write_model_dir(
            spec,
            Path(self._tmp.name) / "model",
            eos_token_id=self.eos_ids[0],
            pad_token_id=pad_token_id,
        )
        if lora is not None and model_dir is None and weights is not None:
            # Under LoRA vLLM wraps every targeted layer once the engine is built, and its
            # load_weights no longer finds them by their names: the base goes in as files it
            # reads at start-up, and `weights` are not loaded again.
            with _took("writing the base for vLLM"):
                _write_weights(folder, weights, spec, dtype)
            model_dir, weights = folder, None
        options: dict[str, Any] = {}
        if max_num_seqs is not None:
            options["max_num_seqs"] = max_num_seqs
        if kv_cache_memory_bytes is not None:
            options["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if lora is not None:
            from runtime.backends.vllm_lora import engine_options

            options.update(engine_options(lora, specialize_active=lora_specialize_active))
        if not custom_all_reduce_allowed(tensor_parallel_size, os.environ):
            options["disable_custom_all_reduce"] = True
        if not engine_in_process:
            # the loads an engine of another process runs, called by name (plain arguments)
            options["worker_extension_cls"] = f"{WorkerExtension.__module__}.WorkerExtension"
        start = time.perf_counter()
        # no room for it (memory taken since the start-up check): what held the GPU, in one line
        with engine_room_explained():
            self.llm = LLM(
                model=str(folder),
                skip_tokenizer_init=True,
                load_format="auto" if model_dir is not None else "dummy",
                dtype=str(dtype).removeprefix("torch."),
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                logprobs_mode=self.logprobs_mode,
                seed=seed,
                enforce_eager=enforce_eager,
                enable_prefix_caching=True,
                **options,
            )
        self.init_seconds = time.perf_counter() - start
        if lora is not None:
            from runtime.backends.vllm_lora import LoraSlots
            from runtime.backends.vllm_lora_slot import InPlace

            # the worker is this process's only with TP=1 in process: tensors reach it as they
            # are, and its GPU slots are this process's memory
            direct = tensor_parallel_size == 1 and engine_in_process
            self.slots = LoraSlots(
                self.llm.llm_engine,
                lora,
                from_memory=self._adapter_from_memory if direct else None,
                in_place=InPlace(self._plan_slot) if direct else None,
            )
        if weights is not None:
            self.load_weights(weights)

    def load_weights(self, hf_state_dict: Mapping[str, Tensor]) -> None:
        """Copy HF-named weights into the engine's model in place; every parameter must get one.

        Call between generations (the actor's endpoints run one at a time). The prefix cache
        holds keys and values of the old weights, so it is emptied afterwards. The tensors go
        to the worker as they are where it is this process (TP=1 in process), else through a
        safetensors file in /dev/shm.
        """
        start = time.perf_counter()
        if self.slots is not None and adapter_only(hf_state_dict):
            self._load_adapter(hf_state_dict, start)
            return
        if self.tensor_parallel_size == 1 and self.engine_in_process:
            missing = self.llm.collective_rpc(load_on_worker, args=(hf_state_dict,))
        else:
            missing = self._load_through_file(hf_state_dict)
        self._after_load(missing, start)

    @property
    def ipc_opens(self) -> int:
        """How many processes open a version handed over by CUDA IPC (`load_ipc`): each of the
        engine's workers (this process with TP=1 in process, the engine core's with TP=1 in a
        process of its own); under LoRA this one alone (it hands the adapter to vLLM)."""
        return 1 if self.slots is not None else self.tensor_parallel_size

    @property
    def _workers_elsewhere(self) -> bool:
        """Whether the engine's workers are other processes (TP>1, or an engine core of its
        own): a flat GPU buffer reaches them by CUDA IPC."""
        return self.tensor_parallel_size > 1 or not self.engine_in_process

    def load_flat(self, flat: Tensor, entries: Mapping[str, Any]) -> None:
        """Load HF-named weights that lie in one flat uint8 buffer of this process at `entries`
        (name -> `runtime.weights.layout.TensorEntry`); like `load_weights` otherwise. Where the
        workers are other processes each opens the buffer through a CUDA IPC handle of its own."""
        from runtime.weights.flat import views

        if not self._workers_elsewhere or flat.device.type != "cuda" or self.slots is not None:
            self.load_weights(views(flat, entries))
            return
        from runtime.weights.ipc import export_ipc

        torch.cuda.current_stream(flat.device).synchronize()
        self._load_on_workers(export_ipc(flat, self.tensor_parallel_size), entries)

    def load_ipc(self, handles: Sequence[Any], entries: Mapping[str, Any]) -> None:
        """`load_flat` for a buffer of another process: `handles` are `ipc_opens` CUDA IPC
        handles of it, one for each process that opens it (this one with TP=1 in process or
        under LoRA, else each worker)."""
        from runtime.weights.flat import views
        from runtime.weights.ipc import open_ipc

        if len(handles) != self.ipc_opens:
            raise ValueError(f"{len(handles)} CUDA IPC handles for {self.ipc_opens} openers")
        if self._workers_elsewhere and self.slots is None:
            self._load_on_workers(handles, entries)
            return
        opening = time.perf_counter()
        flat = open_ipc(handles[0])
        self.ipc_open_s = time.perf_counter() - opening  # the receiver reports it
        try:
            self.load_weights(views(flat, entries))
        finally:
            del flat  # the mapping closes with the last reference

    def _load_on_workers(self, handles: Sequence[Any], entries: Mapping[str, Any]) -> None:
        start = time.perf_counter()
        plain = {name: tuple(e) for name, e in entries.items()}
        if self.engine_in_process:
            missing = self.llm.collective_rpc(load_flat_on_worker, args=(list(handles), plain))
        else:
            from runtime.weights.ipc import plain_handle

            missing = self.llm.collective_rpc(
                "forgesky_load_ipc", args=([plain_handle(h) for h in handles], plain)
            )
        self._after_load(missing, start)

    def _load_adapter(self, tensors: Mapping[str, Tensor], start: float) -> None:
        """An adapter version, over the one before in its GPU slot or into a slot of its own
        (runtime.backends.vllm_lora). Neither the probe (the base weights did not change) nor
        a prefix-cache reset (the cache keys on the adapter's name, new with each version).
        Called between generations only: the actor's endpoints run one at a time, so no
        generation is in flight while the slot is written."""
        check_adapter(tensors, self.spec, self.slots.lora)
        version, self.incoming_version = self.incoming_version, None
        self.slots.load(self.slots.next_version() if version is None else version, tensors)
        self.load_seconds = time.perf_counter() - start

    def _adapter_from_memory(
        self, lora_id: int, tensors: Mapping[str, Tensor], config: dict[str, Any]
    ) -> dict[str, float]:
        from runtime.backends.vllm_worker import add_adapter_on_worker

        return self.llm.collective_rpc(add_adapter_on_worker, args=(lora_id, tensors, config))[0]

    def _plan_slot(
        self, lora_id: int, tensors: Mapping[str, Tensor], config: dict[str, Any]
    ) -> Any:
        from runtime.backends.vllm_worker import plan_slot_on_worker

        return self.llm.collective_rpc(plan_slot_on_worker, args=(lora_id, tensors, config))[0]

    def _after_load(self, missing: Sequence[Sequence[str]], start: float) -> None:
        if any(missing):
            raise KeyError(
                f"weights do not fit the generator: no weight for {sorted(set().union(*missing))[:5]}"
            )
        # Nothing runs between generate calls; if vLLM still holds blocks (an async step), the
        # second form preempts whatever holds them so the reset cannot be skipped.
        if not (
            self.llm.reset_prefix_cache()
            or self.llm.reset_prefix_cache(reset_running_requests=True)
        ):
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
        self.load_seconds = time.perf_counter() - start

    def _load_through_file(self, hf_state_dict: Mapping[str, Tensor]) -> list[list[str]]:
        from safetensors.torch import save_file

        # safetensors refuses tensors that share storage (the store hands out views into
        # buckets), hence the copies; /dev/shm keeps the round trip in memory.
        folder = _SHM if _SHM.is_dir() else Path(self._tmp.name)
        fd, path = tempfile.mkstemp(prefix="forgesky-weights-", suffix=".safetensors", dir=folder)
        os.close(fd)
        try:
            save_file(
                {k: v.detach().to("cpu").contiguous().clone() for k, v in hf_state_dict.items()},
                path,
            )
            if self.engine_in_process:
                return self.llm.collective_rpc(load_on_worker, args=(path,))
            return self.llm.collective_rpc("forgesky_load_file", args=(path,))
        finally:
            Path(path).unlink(missing_ok=True)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: bool = True,
    ) -> list[Completion]:
        """`n` completions per prompt, prompt-major (result[i * n + j] is sample j of prompt i).

        With `seed`, prompt i uses seed + i * n (vLLM gives its j-th sample seed + i * n + j), so
        a call is reproducible whatever else the engine batches with it. Without `logprobs`
        (evaluation) any temperature goes, 0 decoding greedily, and the log-probs are 0.
        """
        from vllm import SamplingParams

        if logprobs and (temperature != self.temperature or top_p != self.top_p):
            raise ValueError(
                f"this engine samples at temperature={self.temperature}, top_p={self.top_p} "
                f"(they fix its log-prob mode); got temperature={temperature}, top_p={top_p}"
            )
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        most = request_tokens(prompts, max_new_tokens, self.max_model_len)

        def params(i: int) -> Any:
            return SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=most[i],
                stop_token_ids=self.eos_ids,
                logprobs=0 if logprobs else None,
                flat_logprobs=True,
                detokenize=False,
                skip_special_tokens=False,
                seed=None if seed is None else (seed + i * n) & 0x7FFFFFFF,
            )

        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(
            requests,
            [params(i) for i in range(len(prompts))],
            use_tqdm=False,
            lora_request=None if self.slots is None else self.slots.current,
        )
        return list(self._completions(prompts, outputs, n, logprobs))

    def _completions(
        self, prompts: Sequence[Sequence[int]], outputs: Sequence[Any], n: int, logprobs: bool
    ) -> Iterable[Completion]:
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        eos = set(self.eos_ids)
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, not {n}")
            for c in samples:
                ids = list(c.token_ids)
                stopped = c.finish_reason == "stop" and bool(ids) and ids[-1] in eos
                yield Completion(
                    prompt_ids=list(prompt),
                    response_ids=ids,
                    response_logprobs=(
                        _sampled_logprobs(ids, c.logprobs) if logprobs else [0.0] * len(ids)
                    ),
                    policy_version=self.policy_version,
                    finish_reason="stop" if stopped else "length",
                    prompt_index=i,
                )

    def close(self) -> None:
        """Stop the engine and free its GPU memory (tests build more than one engine).

        With TP>1, or an engine core of its own, the workers hold vLLM's process groups and the
        engine's shutdown ends them; this process has none to tear down. (TP=2 engines took the
        runtime's 30 s stop bound, the workers gone after 3 s: each part that takes long says so
        on stderr.)"""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with _took("the engine's shutdown"):
                llm.llm_engine.engine_core.shutdown()
            with _took("releasing the engine"):
                del llm
            if self.tensor_parallel_size == 1 and self.engine_in_process:
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                with _took("vLLM's process-group clean-up"):
                    cleanup_dist_env_and_memory()
        if self.slots is not None:
            self.slots.close()
        self._tmp.cleanup()
