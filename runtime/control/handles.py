"""What the controller asks of the services: one async method per thing it needs done.

`Services` (runtime/control/services.py) answers through the run's Monarch actors; the unit
tests answer with plain Python (tests/fake_services.py), so the rollout loop, the freshness
rule, checkpoint state and batching run without a cluster.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor


class ServiceHandles(Protocol):
    generators: int  # generator replicas
    has_reference: bool
    reference_unit: str  # whose GPU turn reference scoring takes: "reference" or "trainer"
    pad_id: int

    async def generate(
        self,
        replica: int,
        prompts: list[list[dict[str, str]]],
        seed: int,
        n: int | None = None,
        temperature: float | None = None,
    ) -> list[dict[str, Any]]:
        """`group_size` completions per prompt, prompt-major: prompt_ids, response_ids,
        response_logprobs, text, finish_reason and the policy_version that sampled each; an
        evaluation asks for `n` at its own `temperature` (0: greedy)."""

    async def continue_tokens(
        self,
        replica: int,
        prompts: list[list[int]],
        seed: int,
        max_new_tokens: int,
        temperature: float | None = None,
    ) -> list[dict[str, Any]]:
        """One completion of each token-id prompt (an episode's next turn): response_ids,
        response_logprobs, policy_version and finish_reason; an evaluation's episodes ask for
        their own `temperature` (0: greedy)."""

    async def score(
        self, items: list[tuple[str, str, str]]
    ) -> list[tuple[float, dict[str, float]]]:
        """(prompt, completion, answer) -> (total reward, per-reward scores)."""

    async def reference_logprobs(self, tokens: Tensor, mask: Tensor) -> list[list[float]]:
        """The reference's log-prob of each response token, one list per row."""

    async def train_step(self, batch: dict[str, Any]) -> dict[str, float]: ...

    async def publish(self, version: int) -> dict[str, Any]:
        """Make the trainer's weights `version` (bytes, seconds, per-path figures, and the
        manifest's `direct` entry where a direct path is in use)."""

    async def load_version(
        self, replica: int, version: int, direct: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """Load `version` (or a newer one at hand) on a generator: version, bytes, seconds.
        `direct`: the publish's `direct` entry, handed to the generator's receiver."""

    async def version_loaded(self, version: int) -> None:
        """Every generator has loaded `version`: the trainer frees its direct-path buffers."""

    async def drop(self, version: int) -> None: ...

    async def weight_endpoints(self) -> tuple[Any, list[Any]]:
        """Where the trainer's and each generator's weights live (transport.Endpoint)."""

    async def open_weights(
        self, paths: list[str], ipc_opens: list[int] | None = None
    ) -> dict[str, Any]:
        """Serve `paths` (one per generator; `ipc_opens`: how many processes of each open a
        version) on the trainer; what their receivers need."""

    async def connect_generator(self, replica: int, path: str, link: Any) -> None: ...

    async def close_weights(self) -> None: ...

    async def save(self, directory: str) -> None:
        """Start writing the trainer's state into a checkpoint directory (returns at once; the
        copy to host memory and the files follow in the background)."""

    async def saved(self, wait: bool) -> bool:
        """Whether the trainer's last checkpoint write is on disk; with `wait`, once it is."""

    async def written_after_failure(self, probe_s: float, wait_s: float) -> bool:
        """After the run ended early: whether that write reached disk, each trainer rank
        answering within `probe_s` and the write ending within `wait_s` (False otherwise)."""

    async def restore(self, directory: str) -> int:
        """The trainer's state from a checkpoint directory; the optimizer step restored."""

    async def export(self, directory: str, provenance: dict[str, Any]) -> None:
        """The policy as a Hugging Face model folder."""

    def fail(self, error: BaseException) -> None:
        """A background task of the controller died: end the run with its cause."""
