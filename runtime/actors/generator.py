"""The generator actor: samples groups of completions and switches policy versions between them."""

from __future__ import annotations

import threading
import time
from typing import Any

from monarch.actor import Actor, endpoint

from runtime.backends import build
from runtime.procs.cpus import CpuWatch, GcClock
from runtime.procs.mps import client_sm_percent
from runtime.procs.usage import thread_usage


class GeneratorActor(Actor):
    def __init__(self) -> None:
        self.backend: Any = None
        self.store: Any = None
        self.tokenizer: Any = None
        self.recipe: Any = None
        self.settings: Any = None
        # How policy versions arrive (runtime.weights.transport): the store until the
        # controller connects this generator's path.
        self.receiver: Any = None

    @endpoint
    async def setup(self, recipe: Any, settings: Any, store: Any) -> dict[str, Any]:
        """Build the sampling model (`settings`: the plan's recipes.settings.Settings); its
        weights arrive with the first `update_weights`."""
        self.recipe, self.settings, self.store = recipe, settings, store
        self.tokenizer = build.load_tokenizer(recipe)
        self.backend = build.GeneratorConfig(recipe, settings.generator).build(self.tokenizer)
        self.backend.policy_version = -1
        return {
            "device": str(build.device()),
            "backend": type(self.backend).__name__,
            "pad_id": build.pad_id(self.tokenizer),  # the controller pads batches with it
            "mps_sm_percent": client_sm_percent(),
        }

    @endpoint
    async def weight_endpoint(self) -> Any:
        """Where this generator's weights live (host, GPU, TP width): picks its weight path."""
        from runtime.weights.transport import endpoint

        return endpoint(
            tp=self.recipe.layout.generator.tp, ipc_opens=getattr(self.backend, "ipc_opens", 1)
        )

    @endpoint
    async def connect_weights(self, path: str, connection: Any = None) -> None:
        """Take policy versions by `path` (store | ipc | push), with what its sender opened."""
        from runtime.weights.transport import receiver

        if self.receiver is not None:
            self.receiver.close()
        timeout_s = self.settings.weight_sync.timeout_s
        self.receiver = receiver(path, self.store, build.device(), connection, timeout_s)

    @endpoint
    async def update_weights(
        self, version: int, direct: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """Load policy `version` (or a newer one already pushed here), replacing the previous one.
        `direct`: the `direct` entry of the version's manifest, handed over by the controller
        from the publish (a direct path's receiver then does not fetch it from the store).

        Endpoints run one at a time, so this starts only after the generation in flight has
        returned: no completion mixes two versions. Returns the version loaded, the bytes and
        the seconds this took (for "push", the wait for bytes still in flight included).
        """
        from runtime.weights.transport import receiver

        start = time.perf_counter()
        if self.receiver is None:
            self.receiver = receiver("store", self.store, build.device())
        if hasattr(self.backend, "incoming_version"):  # vLLM names a LoRA version after it
            self.backend.incoming_version = version
        # The receiver's awaits only wait for the bytes; the load itself (backend.load_weights)
        # runs on this actor's thread without yielding, as `generate` does: a version written
        # over the one before in place (vLLM's LoRA slot) never lands inside a generation.
        loaded, nbytes = await self.receiver.load(version, self.backend, direct)
        self.backend.policy_version = loaded
        out = {"version": loaded, "bytes": nbytes, "seconds": time.perf_counter() - start}
        # a LoRA version into vLLM from memory, in parts: its build (vLLM's LoRAModel) and slot
        # activation, or its write in place (runtime.backends.vllm_lora)
        slots = getattr(self.backend, "slots", None)
        for part, seconds in (getattr(slots, "timings", None) or {}).items():
            out[f"adapter_{part}"] = seconds
        # and the receipt's parts (CUDA IPC): the manifest, the handle's opening, the load
        for part, seconds in (getattr(self.receiver, "timings", None) or {}).items():
            out[f"receive_{part}"] = seconds
        return out

    @endpoint
    async def close(self) -> None:
        """End the engine before the proc stops: vLLM's process group and TP workers are torn
        down in order (left to the interpreter's exit, NCCL warns of a leak)."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        close = getattr(self.backend, "close", None)
        self.backend = None
        if close is not None:
            close()

    @endpoint
    async def generate(
        self,
        prompts: list[list[dict[str, str]]],
        seed: int | None = None,
        n: int | None = None,
        temperature: float | None = None,
    ) -> list[dict[str, Any]]:
        """`group_size` completions per prompt (chat messages), prompt-major, each with token ids,
        log-probs, decoded text and the policy version that sampled it. An evaluation asks for
        `n` completions at its own `temperature` (0: greedy), without log-probs."""
        g = self.recipe.grpo
        ids = [self._encode(p) for p in prompts]
        # one clock for the call's seconds and its window against the push receiver's
        start, usage = time.monotonic(), thread_usage()
        # where that thread ran: a call's speed can follow its CPU (sampled every 50 ms)
        watch = CpuWatch([("self", threading.get_native_id())])
        gc_clock = GcClock()  # the collector holds the GIL: the engine's thread waits
        evaluating = n is not None or temperature is not None
        try:
            completions = self.backend.generate(
                ids,
                n=g.group_size if n is None else n,
                max_new_tokens=g.max_response_tokens,
                temperature=g.temperature if temperature is None else temperature,
                top_p=g.top_p,
                seed=seed,
                logprobs=not evaluating,
            )
        finally:  # a failed call leaves no sampling thread and no GC callback behind
            end = time.monotonic()
            # the engine's steps run on this thread: what it spent besides waiting on the GPU
            spent = None if usage is None else thread_usage().since(usage)
            seen = watch.stop()
            collected = gc_clock.stop()
        elapsed = end - start
        out = []
        for c in completions:
            out.append(
                {
                    "prompt_ids": c.prompt_ids,
                    "response_ids": c.response_ids,
                    "response_logprobs": c.response_logprobs,
                    "policy_version": c.policy_version,
                    "finish_reason": c.finish_reason,
                    "text": self.tokenizer.decode(c.response_ids, skip_special_tokens=True),
                }
            )
        if out:
            out[0]["time/generate_s"] = elapsed
            if spent is not None:
                out[0].update(spent.as_metrics("generator/engine_thread"))
            # how many CPUs it was seen on, and how often a sample found it moved
            out[0]["generator/engine_thread_cpus_seen"] = float(len(next(iter(seen.values()))))
            out[0]["generator/engine_thread_cpu_moves"] = float(sum(watch.moves.values()))
            # seconds the hypervisor took from those CPUs meanwhile (0 off a virtual machine)
            out[0]["generator/engine_thread_cpu_steal_s"] = watch.stolen_s()
            out[0]["generator/gc_s"] = collected["gc_s"]  # this process's, during the call
            # a pushed version arriving meanwhile shared the GPU with the engine for this long
            receiving = getattr(self.receiver, "receiving_between", None)
            if receiving is not None:
                out[0]["generator/push_overlap_s"] = receiving(start, end)
        return out

    @endpoint
    async def continue_tokens(
        self,
        prompts: list[list[int]],
        seed: int | None,
        max_new_tokens: int,
        temperature: float | None = None,
    ) -> list[dict[str, Any]]:
        """One completion of each prompt, given as token ids (an episode's next turn: its
        opening and turns so far), with log-probs, the policy version that sampled it and
        whether it ended on an end token ("stop") or at `max_new_tokens` ("length");
        `temperature` (an evaluation's; 0: greedy) replaces the run's."""
        g = self.recipe.grpo
        start = time.monotonic()
        completions = self.backend.generate(
            prompts,
            n=1,
            max_new_tokens=max_new_tokens,
            temperature=g.temperature if temperature is None else temperature,
            top_p=g.top_p,
            seed=seed,
            logprobs=temperature is None,  # an evaluation's turns train nothing
        )
        elapsed = time.monotonic() - start
        out = [
            {
                "response_ids": c.response_ids,
                "response_logprobs": c.response_logprobs,
                "policy_version": c.policy_version,
                "finish_reason": c.finish_reason,
            }
            for c in completions
        ]
        if out:  # the engine's own seconds (the rest of a turn: its way here and back)
            out[0]["time/generate_s"] = elapsed
        return out

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        r = self.recipe
        return build.encode_messages(
            self.tokenizer, messages, r.grpo.max_prompt_tokens, r.model.thinking
        )
