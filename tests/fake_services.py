"""Services in plain Python for the controller's unit tests (`runtime.control.handles`).

Every completion carries the policy version that sampled it in its first response token
(`VERSION_TOKEN + version`), so the fake trainer can see how stale each row it trains on is;
delays stand in for generation, reference scoring and weight loads.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.weights.transport import Endpoint

VERSION_TOKEN = 1000
PROMPT_TOKEN = 5000


@dataclass
class FakeServices:
    generators: int = 1
    has_reference: bool = True
    reference_unit: str = "reference"
    pad_id: int = 0
    group_size: int = 4
    generate_s: float = 0.0  # seconds per generate call (jittered by `jitter`)
    reference_s: float = 0.0
    load_s: float = 0.0
    # > 0: loads are LoRA versions into vLLM, replica r's adapter built in adapter_s * (r + 1)
    adapter_s: float = 0.0
    jitter: float = 0.0
    seed: int = 0
    loaded: list[int] = field(default_factory=list)
    version: int = 0  # the trainer's optimizer steps
    staleness: list[int] = field(default_factory=list)  # per trained row
    trained_prompts: list[list[int]] = field(default_factory=list)  # per step
    calls: list[tuple[int, int]] = field(default_factory=list)  # (replica, version) per call
    greedy_calls: list[tuple[int, int]] = field(default_factory=list)  # those at temperature 0
    failures: list[BaseException] = field(default_factory=list)
    in_flight: int = 0  # generate calls running now
    # prompts whose completions all score 0 (no learning signal): prompt id % this == 0
    flat_every: int = 0
    advantages: list[list[float]] = field(default_factory=list)  # per step
    reward_name: str = "builtin:tiny"  # the key of the one reward's score
    exported: list[tuple[str, dict]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loaded = [-1] * self.generators
        self.handed: list[tuple[int, int, int | None]] = []  # (replica, version, direct's)
        self._rng = random.Random(self.seed)

    async def _pause(self, seconds: float) -> None:
        if seconds or self.jitter:
            await asyncio.sleep(seconds + self._rng.uniform(0, self.jitter))

    async def generate(
        self, replica: int, prompts: list, seed: int, n: int | None = None, temperature=None
    ) -> list[dict[str, Any]]:
        version = self.loaded[replica]
        group = self.group_size if n is None else n
        self.calls.append((replica, version))
        if temperature == 0:
            self.greedy_calls.append((replica, version))
        self.in_flight += 1
        try:
            await self._pause(self.generate_s)
        finally:
            self.in_flight -= 1
        out = []
        for messages in prompts:
            text = messages[-1]["content"]
            prompt_id = int(text.split()[-1])
            for j in range(group):
                response = [VERSION_TOKEN + version, 10 + j, 20 + prompt_id % 7][: 1 + j % 3]
                # greedy decoding "learns": right (":0") once the version reaches prompt_id % 8
                greedy_right = version >= prompt_id % 8
                text = f"{prompt_id}:{j}" if temperature != 0 or greedy_right else f"{prompt_id}:9"
                out.append(
                    {
                        "prompt_ids": [1, PROMPT_TOKEN + prompt_id],
                        "response_ids": response,
                        "response_logprobs": [-0.5] * len(response),
                        "text": text,
                        "policy_version": version,
                    }
                )
        return out

    async def score(self, items: list[tuple[str, str, str]]) -> list[tuple[float, dict]]:
        # rewards differ within a group (every group has a learning signal), except in the
        # groups of every `flat_every`-th prompt, which all score 0
        out = []
        for _, completion, _ in items:
            prompt_id = int(completion.split(":")[0])
            flat = self.flat_every and prompt_id % self.flat_every == 0
            value = 0.0 if flat else float(completion.endswith(":0"))
            out.append((value, {self.reward_name: value}))
        return out

    async def reference_logprobs(self, tokens: torch.Tensor, mask: torch.Tensor) -> list:
        await self._pause(self.reference_s)
        return [[-0.7] * int(row.sum()) for row in mask]

    async def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        tokens, mask = batch["tokens"], batch["response_mask"]
        first = mask.float().argmax(dim=1)
        rows = range(0, tokens.shape[0], self.group_size)
        self.trained_prompts.append([int(tokens[row, 1]) - PROMPT_TOKEN for row in rows])
        for row in range(tokens.shape[0]):
            if mask[row].any():
                sampled_by = int(tokens[row, first[row]]) - VERSION_TOKEN
                self.staleness.append(self.version - sampled_by)
        assert batch["ref_logprobs"] is None or batch["ref_logprobs"].shape == tokens.shape
        self.advantages.append(batch["advantages"].tolist())
        self.version += 1
        return {"loss": 0.0, "kl": 0.0, "time/train_s": 0.0}

    async def publish(self, version: int) -> dict[str, Any]:
        assert version == self.version, (version, self.version)
        # a direct path's part of the manifest, as runtime.weights.transport.Publisher hands it
        return {"bytes": 0, "seconds": 0.0, "direct": {"version": version}}

    async def load_version(
        self, replica: int, version: int, direct: dict[str, Any] | None = None
    ) -> dict[str, float]:
        # what the publish of the version handed over comes with its load
        self.handed.append((replica, version, None if direct is None else direct["version"]))
        await self._pause(self.load_s)
        self.loaded[replica] = max(self.loaded[replica], version)
        out = {"version": self.loaded[replica], "bytes": 0, "seconds": self.load_s}
        if self.adapter_s:
            build = self.adapter_s * (replica + 1)
            out.update(adapter_build_s=build, adapter_activate_s=self.adapter_s / 2)
            # and its receipt's part (a CUDA IPC manifest), in the same generator's record
            out["receive_manifest_s"] = build / 10
            out["seconds"] += build + self.adapter_s / 2
        return out

    async def version_loaded(self, version: int) -> None:
        return None

    async def drop(self, version: int) -> None:
        return None

    async def weight_endpoints(self) -> tuple[Any, list[Any]]:
        return Endpoint("here", None), [Endpoint("here", None)] * self.generators

    async def open_weights(
        self, paths: list[str], ipc_opens: list[int] | None = None
    ) -> dict[str, Any]:
        return {p: None for p in paths}

    async def connect_generator(self, replica: int, path: str, link: Any) -> None:
        return None

    async def close_weights(self) -> None:
        return None

    async def save(self, directory: str) -> None:
        torch.save({"step": self.version}, Path(directory) / "trainer.pt")

    async def export(self, directory: str, provenance: dict[str, Any]) -> None:
        self.exported.append((directory, dict(provenance)))

    async def saved(self, wait: bool) -> bool:
        return True

    async def written_after_failure(self, probe_s: float, wait_s: float) -> bool:
        return True

    async def restore(self, directory: str) -> int:
        self.version = torch.load(Path(directory) / "trainer.pt")["step"]
        return self.version

    def fail(self, error: BaseException) -> None:
        self.failures.append(error)


class FakeMetrics:
    """The step records a run would log."""

    wandb_run_id = None

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.records.append({"step": step, **record})
