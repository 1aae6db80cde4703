"""The trainer's part of a checkpoint: `torch.distributed.checkpoint` (DCP) in a folder.

Every trainer rank writes its own shards of the weights and AdamW moments (FSDP2 DTensors, or
whole tensors on one process) and rank 0 the metadata plus the small state (scheduler, step), so
no rank ever gathers the model. Reading reshards: a checkpoint written by N ranks loads into M
ranks, into the one-process CPU trainer, or into a plain model for export and evaluation.

Keys are the model's parameter names (the fused q/k/v projection as the model holds it, so a
save gathers nothing) and, for the optimizer, `torch.distributed.checkpoint.state_dict`'s
parameter-name keyed form. The model's part is what the trainer updates (`trained`): every
weight, or a LoRA run's adapter alone (`lora_a`/`lora_b`; the frozen base is the run's first
weights, read again on a resume; runtime.backends.checkpoint_read.saved_kind tells them apart). A checkpoint folder from before DCP (one `trainer.pt`) still loads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from runtime.backends.checkpoint_read import TRAINER_DIR, is_legacy, read_all

# Files each rank writes at once (threads of DCP's writer). The state is in host memory when
# the write starts, so the writer has no GPU work to wait for; with one thread DCP would still
# synchronise the thread's current CUDA stream every 10 MB, and a training stream blocked in a
# collective then stops the checkpoint write too.
WRITE_THREADS = 4


def _single() -> bool:
    return not dist.is_initialized()


def trained(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters a trainer updates, by name: every one, or a LoRA run's adapter alone
    (its frozen base comes from the run's first weights, never from a checkpoint)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _state(model: torch.nn.Module, optimizer: Any, scheduler: Any, step: int) -> dict[str, Any]:
    """What a checkpoint holds, as live objects: DCP saves from them and loads into them."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {
        "model": trained(model),
        # Creates AdamW's moments (zeros) if no step ran yet: a template to load into.
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict(),
        "step": step,
    }


def save(
    directory: str | Path, model: torch.nn.Module, optimizer: Any, scheduler: Any, step: int
) -> None:
    """Write this rank's shards and wait for them (every trainer rank calls it)."""
    saver = Saver()
    saver.start(directory, model, optimizer, scheduler, step)
    saver.close()


class Saver:
    """A trainer rank's checkpoint writes, one in flight at a time. `start` returns at once: a
    background thread copies this rank's state to host memory (`staged` waits for that copy, and
    must be called before anything changes the state, i.e. before an optimizer step), then DCP
    writes the files from that copy (`written` says when they are on disk)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.future: Any = None
        self.folder = ""  # where the write in flight goes
        self.files: _FilesWithErrors | None = None  # its files, with what failed writing them
        self.staging: Any = None
        self.group: Any = None
        # One stager for the run: its host copy of the state is kept between writes and, on a
        # GPU, pinned (registered with CUDA once) and filled by non-blocking copies on a stream
        # of its own, so a checkpoint costs the training loop only what the copy has not
        # finished by the next optimizer step. (qwen3-8b and llama3.1-8b on two H200s, 48 GB a
        # rank staged while the loop waited: the step after a checkpoint came 73-79 s late.)
        self.stager: Any = None

    def start(
        self,
        directory: str | Path,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        step: int,
    ) -> None:
        self.written(wait=True)
        self.staged()  # a copy `prepare` started
        if not _single() and self.group is None:
            # The write's own collectives run in the background thread: a gloo group of their
            # own keeps them apart from the training collectives on the default group.
            self.group = dist.new_group(backend="gloo")
        if self.stager is None:
            self.stager = _stager(self.device)
        if self.device.type == "cuda":
            # the copy runs on a stream of its own, which does not wait for this one: the
            # step's last kernels (the optimizer's) must be done before it reads the state
            torch.cuda.current_stream(self.device).synchronize()
        folder = str(Path(directory) / TRAINER_DIR)
        writer = dcp.FileSystemWriter(folder, thread_count=WRITE_THREADS)
        writer.fs = self.files = _FilesWithErrors()
        response = dcp.async_save(
            _state(model, optimizer, scheduler, step),
            checkpoint_id=folder,
            storage_writer=writer,
            process_group=self.group,
            async_stager=self.stager,
            no_dist=_single(),
        )
        self.staging = getattr(response, "staging_completion", None)
        self.future = getattr(response, "upload_completion", response)
        self.folder = folder

    def prepare(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, step: int) -> None:
        """Make this rank's host copy of the state now, in the background, so that the first
        write fills it instead of making it. On a GPU that copy is about 12 bytes a parameter
        of new host memory, pinned, and pinning it holds up this process's other CUDA work:
        qwen3-8b on two H200s (48 GB a rank), a 0.66 s training step took 28.5 s beside the
        first write and 2.4 s beside the second, which reuses the memory; made before the
        first step, that step took 23.0 s and the first write's 1.8 s
        (bench/results/gpu_h200x4_2026-11-27b). The runtime starts it while the other
        services start. `staged` waits for it like for a write's copy. Before the first
        optimizer step it creates AdamW's moments (zeros) with step counts of 0, which is what
        that step would create."""
        self.staged()
        if self.stager is None:
            self.stager = _stager(self.device)
        fresh = not optimizer.state
        state = _state(model, optimizer, scheduler, step)
        if fresh:  # DCP made the moments by an optimizer step at lr 0 on zero gradients
            for moments in optimizer.state.values():
                if isinstance(moments.get("step"), torch.Tensor):
                    moments["step"].zero_()
                elif "step" in moments:
                    moments["step"] = 0
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.staging = self.stager.stage(state)

    def staged(self) -> float:
        """Wait until the last write's copy of the state is in host memory (this rank's; no
        collective); the seconds waited. A failed copy raises here."""
        if self.staging is None:
            return 0.0
        start = time.perf_counter()
        try:
            self.staging.result()
        finally:
            self.staging = None
        return time.perf_counter() - start

    def written(self, wait: bool = False) -> bool:
        """Whether the last write is on disk on every rank (a collective with several ranks);
        with `wait`, block until it is. A failed write raises here."""
        done = self.future is None or wait or self.future.done()
        if not _single():
            flag = torch.tensor([int(done)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = bool(flag.item())
        if done and self.future is not None:
            self.staged()
            future, self.future = self.future, None
            try:
                future.result()
            except BaseException as e:
                self._failed(e)
                raise
            # DCP's own writer threads end on an error without telling its caller (torch
            # 2.11-2.13: their files are left out of the metadata, and the write "succeeds")
            if self.files is not None and self.files.errors:
                self._failed(self.files.errors[0])
        return done

    def _failed(self, error: BaseException) -> None:
        """Raise what went wrong writing `self.folder`, by the OSError under `error` where
        there is one (a full disk fails torch.save with "unexpected pos" over ENOSPC)."""
        cause = _os_error(error)
        if cause is not None:
            raise OSError(
                cause.errno, f"checkpoint write to {self.folder} failed: {cause.strerror}"
            ) from error
        raise RuntimeError(
            f"checkpoint write to {self.folder} failed: {type(error).__name__}: {error}"
        ) from error

    def close(self) -> None:
        """Wait for the last write, then free the host copy (and unpin it)."""
        try:
            self.written(wait=True)
            self.staged()
        finally:
            if self.stager is not None:
                self.stager.close()
                self.stager = None


class _FilesWithErrors(dcp.filesystem.FileSystem):
    """DCP's local files, keeping every error raised while one of them was open for writing
    (in DCP's writer threads too, where nothing else sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[BaseException] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except BaseException as e:
            self.errors.append(e)
            raise


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what lies under it, breadth first: the errors DCP's CheckpointException
    keeps by rank (each as (error, traceback)), then causes and contexts."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for failure in (getattr(e, "failures", None) or {}).values():
            failure = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(failure, BaseException):
                todo.append(failure)
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]


def _os_error(error: BaseException) -> OSError | None:
    """The first OSError with an errno in `error_chain(error)`."""
    return next((e for e in error_chain(error) if isinstance(e, OSError) and e.errno), None)


def _stager(device: torch.device) -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    class KeptStager(DefaultStager):
        """DCP's DefaultStager, keeping its host copy from one write to the next. torch 2.11's
        empties its copier after every copy, the cache of host storages and the table of
        copiers alike (so a second copy fails on a plain dict: KeyError(<class 'type'>));
        later versions keep both. Here the copy is made the same way, without that."""

        def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
            stream = self._staging_stream if self._config.use_non_blocking_copy else None
            if stream is None:
                return self._state_dict_stager.stage(state_dict, non_blocking=False)
            with stream:
                staged = self._state_dict_stager.stage(state_dict, non_blocking=True)
            stream.synchronize()  # the non-blocking copies are done when the future is
            return staged

    cuda = device.type == "cuda"
    options = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=cuda,
    )
    if not cuda:
        return KeptStager(options)
    # its copy stream belongs to the trainer's GPU
    with torch.cuda.device(device):
        return KeptStager(options)


def load(directory: str | Path, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> int:
    """Restore weights, moments and schedule from `directory` (resharded to this layout);
    returns the step. Every trainer rank calls it."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = _state(model, optimizer, scheduler, 0)
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(Path(directory) / TRAINER_DIR), no_dist=_single())
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


class Checkpointing:
    """The checkpoint methods of a trainer backend (`model`, `optimizer`, `scheduler`, `step`,
    `device` and `load_state_dict` are the backend's)."""

    _saver: Saver | None = None

    def save_checkpoint(self, directory: str) -> None:
        """Start writing the trainer's part of a checkpoint into `directory` (DCP: every rank
        its own shards; runtime.backends.trainer_state): returns at once; the state is copied
        to host memory in the background (`checkpoint_staged` before the next optimizer step)
        and the files follow (`checkpoint_written`). Every rank must call it."""
        if self._saver is None:
            self._saver = Saver(self.device)
        self._saver.start(directory, self.model, self.optimizer, self.scheduler, self.step)

    def prepare_checkpoint_copy(self, on_cpu: bool = False) -> bool:
        """On a GPU, start making the host copy that checkpoints are staged into (`Saver.prepare`)
        and say so; elsewhere nothing (host memory needs no pinning) and False, unless `on_cpu`
        (benches and tests trying it there). Every rank calls it, before the first optimizer
        step (a resume then refreshes the copy)."""
        if self.device.type != "cuda" and not on_cpu:
            return False
        if self._saver is None:
            self._saver = Saver(self.device)
        self._saver.prepare(self.model, self.optimizer, self.scheduler, self.step)
        return True

    def checkpoint_staged(self) -> dict[str, float]:
        """Wait until the last checkpoint's copy of the state is in host memory: called before
        anything changes the state (the optimizer step). After a checkpoint, a metric of the
        seconds this rank waited for the copy; otherwise nothing."""
        if self._saver is None or self._saver.staging is None:
            return {}
        return {"time/checkpoint_staging_wait_s": self._saver.staged()}

    def checkpoint_written(self, wait: bool = False) -> bool:
        """Whether the last checkpoint write is on disk on every rank (with `wait`, once it
        is). Every rank must call it."""
        return self._saver is None or self._saver.written(wait)

    def load_checkpoint(self, directory: str) -> None:
        """Restore from `directory`, whatever rank count wrote it. Every rank must call it."""
        if self._saver is not None:
            self._saver.staged()  # a host copy in the making reads the state being replaced
        if is_legacy(directory):
            self.load_state_dict(read_all(directory))
        else:
            self.step = load(directory, self.model, self.optimizer, self.scheduler)
        if self._saver is not None and self._saver.stager is not None:
            # the copy follows the loaded state (the same host memory where the load kept the
            # tensors it loaded into)
            self._saver.prepare(self.model, self.optimizer, self.scheduler, self.step)
