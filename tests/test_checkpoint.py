import json
import os

import pytest

from recipes import UserError
from runtime.control import checkpoint


def write(root, step, payload=b"weights"):
    d = checkpoint.begin(root, step)
    (d / "trainer.pt").write_bytes(payload)
    (d / "controller.json").write_text(json.dumps({"step": step}))
    return checkpoint.commit(root, d, step, keep=2)


def test_commit_makes_a_checkpoint_that_latest_finds(tmp_path):
    ck = write(tmp_path, 5)
    assert ck.path.name == "step_000005"
    assert (ck.path / checkpoint.MARKER).is_file()
    assert checkpoint.latest(tmp_path) == ck


def test_partial_directories_are_never_resumed(tmp_path):
    write(tmp_path, 5)
    partial = checkpoint.begin(tmp_path, 10)
    (partial / "trainer.pt").write_bytes(b"half")
    assert checkpoint.latest(tmp_path).step == 5


def test_renamed_but_unmarked_directory_is_ignored(tmp_path):
    # a crash between the rename and the marker
    write(tmp_path, 5)
    (tmp_path / "step_000010").mkdir()
    (tmp_path / "step_000010" / "trainer.pt").write_bytes(b"x")
    assert checkpoint.latest(tmp_path).step == 5


def test_only_the_last_k_are_kept(tmp_path):
    for s in (1, 2, 3, 4):
        write(tmp_path, s)
    assert [c.step for c in checkpoint.committed(tmp_path)] == [3, 4]


def test_truncated_file_in_committed_checkpoint_is_a_clear_user_error(tmp_path):
    ck = write(tmp_path, 7, payload=b"0123456789")
    (ck.path / "trainer.pt").write_bytes(b"01234")
    with pytest.raises(UserError, match=r"trainer.pt: checkpoint file is cut short"):
        checkpoint.latest(tmp_path)


def test_empty_or_missing_dir_has_no_checkpoint(tmp_path):
    assert checkpoint.latest(tmp_path / "nope") is None
    assert checkpoint.latest(tmp_path) is None


def test_approx_size_reads_as_a_progress_line_would():
    from runtime.control.checkpoint import approx_size

    assert approx_size(12 * 1_720_574_976) == "~21 GB"  # qwen3-1.7b's checkpoint
    assert approx_size(2 * 1_720_574_976) == "~3.4 GB"  # its bf16 export
    assert approx_size(4.5e8) == "~450 MB"
    assert approx_size(899_328) == "~0.9 MB"
    assert approx_size(0) == "~0.1 MB"


def test_each_checkpoint_holds_its_own_steps_state_while_training_goes_on(tmp_path):
    """The trainer's saver copies the state in the background and writes from the copy: once
    `staged` returns (the backends call it before each optimizer step) the weights may change
    in place and the checkpoint still holds the step it was started at. One stager serves the
    run (its host copy is reused: pinned once on a GPU)."""
    import torch

    from runtime.backends import trainer_state

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    saver = trainer_state.Saver()
    weights = {}
    stagers = set()
    for step in (1, 2, 3):
        model(torch.randn(2, 4)).sum().backward()
        assert saver.staged() >= 0.0  # the previous write's copy, before the step changes it
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        weights[step] = model.weight.detach().clone()
        saver.start(tmp_path / f"step_{step}", model, optimizer, scheduler, step)
        stagers.add(id(saver.stager))
        saver.staged()
        assert saver.staging is None
        with torch.no_grad():
            model.weight.add_(100.0)  # training goes on before the files are written
    saver.close()
    assert len(stagers) == 1 and saver.stager is None
    for step in (1, 2, 3):
        state = trainer_state.read_all(tmp_path / f"step_{step}")
        assert state["step"] == step
        assert torch.equal(state["model"]["weight"], weights[step]), step


def test_a_checkpoint_the_run_waits_for_says_how_much_is_on_disk(tmp_path, monkeypatch, capsys):
    """At the end of a run (or on a stop) the run waits for its last checkpoint: 96 GB for an
    8B model took 106 s on two H200s. Every WRITE_PROGRESS_S a line says how far it is."""
    import asyncio

    from runtime.control import controller
    from runtime.control.checkpoint import bytes_under

    folder = tmp_path / "step_000003.partial"
    (folder / "trainer").mkdir(parents=True)
    (folder / "trainer" / "__0_0.distcp").write_bytes(b"x" * 3_000_000)
    (folder / "trainer" / "__1_0.distcp").write_bytes(b"x" * 1_000_000)
    assert bytes_under(folder) == 4_000_000 and bytes_under(tmp_path / "nothing") == 0
    monkeypatch.setattr(controller, "WRITE_PROGRESS_S", 0.05)

    async def scenario():
        task = asyncio.ensure_future(controller._report_writing(folder, 96e9, 3))
        await asyncio.sleep(0.12)
        task.cancel()

    asyncio.run(scenario())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("checkpoint of step 3: 4.0 MB of ~96 GB on disk ("), lines


def test_the_host_copy_of_the_state_is_made_once_and_reused(tmp_path):
    """The second write copies into the host memory the first allocated (on a GPU: pinned,
    which takes seconds a GB to register). torch 2.11's DefaultStager emptied its copier after
    each copy: no host copy was kept, and the second write failed (KeyError(<class 'type'>)),
    which only that version shows (the nodes' torch, pinned by vLLM)."""
    import torch

    from runtime.backends import trainer_state

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    saver = trainer_state.Saver()
    copies = []
    for step in (1, 2):
        saver.start(tmp_path / f"step_{step}", model, optimizer, scheduler, step)
        assert saver.written(wait=True)
        cache = saver.stager._state_dict_stager._cached_storage_mapping
        copies.append(sorted(host.data_ptr() for host in cache.values()))
    # weight, bias, and each one's two moments and step count
    assert len(copies[0]) == 8 and copies[1] == copies[0]
    saver.close()
    assert trainer_state.read_all(tmp_path / "step_2")["step"] == 2


def test_a_host_copy_made_before_training_is_the_one_the_first_write_fills(tmp_path):
    """`Saver.prepare` makes the host copy before the first optimizer step (the runtime calls
    it while the other services start, so that pinning it on a GPU overlaps no training
    step). It creates AdamW's moments early; the steps after it are the steps a run without it
    takes, bit for bit, and the first write copies into the memory it made."""
    import torch

    from runtime.backends import trainer_state

    def run(prepare: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
        saver = trainer_state.Saver()
        made = []
        if prepare:
            saver.prepare(model, optimizer, scheduler, 0)
            assert saver.staging is not None
            cache = saver.stager._state_dict_stager._cached_storage_mapping
        for step in (1, 2, 3):
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).pow(
                2
            ).sum().backward()
            saver.staged()
            if prepare and step == 1:
                made = sorted(host.data_ptr() for host in cache.values())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        saver.start(tmp_path / f"prepared_{prepare}", model, optimizer, scheduler, 3)
        assert saver.written(wait=True)
        filled = sorted(
            h.data_ptr() for h in saver.stager._state_dict_stager._cached_storage_mapping.values()
        )
        saver.close()
        return model, optimizer, made, filled

    model, optimizer, made, filled = run(prepare=True)
    plain_model, plain_optimizer, _, _ = run(prepare=False)
    # weight, bias, and each one's two moments and step count
    assert len(made) == 8 and filled == made
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)
        mine, theirs = optimizer.state[p], plain_optimizer.state[q]
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    state = trainer_state.read_all(tmp_path / "prepared_True")
    assert state["step"] == 3 and torch.equal(state["model"]["weight"], model.weight)


class SmallDisk:
    """os.statvfs for a disk of `capacity` bytes (1-byte blocks) holding what is under
    `root`; `capacity` 0: a filesystem that gives no size (some bucket mounts)."""

    def __init__(self, root, capacity):
        self.root, self.capacity = root, capacity

    def __call__(self, path):
        free = max(0, self.capacity - checkpoint.bytes_under(self.root))
        return os.statvfs_result((1, 1, self.capacity, free, free, 0, 0, 0, 0, 255))


def test_a_short_disk_loses_older_checkpoints_first_and_never_the_newest(tmp_path, monkeypatch):
    """Before a write the controller asks for room: older committed checkpoints go, oldest
    first, until the next fits; the newest (what a resume reads) stays even where the room is
    still short, and the caller is told how much is free."""
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        partial = checkpoint.begin(root, step)
        (partial / "weights").write_bytes(b"x" * 1000)
        checkpoint.commit(root, partial, step, keep=3)
    each = checkpoint.bytes_under(root / "step_000001")  # its file and its marker
    cut_off = root / "step_000004.partial"  # a write a crash cut off
    cut_off.mkdir()
    (cut_off / "weights").write_bytes(b"x" * 600)
    monkeypatch.setattr(checkpoint.os, "statvfs", SmallDisk(root, capacity=5000))
    assert checkpoint.room(root) == 5000 - each
    assert checkpoint.make_room(root, need=1000) == (5000 - 3 * each - 600, [])
    assert cut_off.exists(), "nothing is deleted where there is room"
    assert checkpoint.make_room(root, need=1500) == (5000 - 3 * each, [])
    assert not cut_off.exists(), "a cut-off write goes before any committed checkpoint"
    free, deleted = checkpoint.make_room(root, need=2500)
    assert [c.step for c in deleted] == [1] and free == 5000 - 2 * each
    assert [c.step for c in checkpoint.committed(root)] == [2, 3]
    free, deleted = checkpoint.make_room(root, need=5000)
    assert [c.step for c in deleted] == [2] and free == 5000 - each
    assert [c.step for c in checkpoint.committed(root)] == [3], "the newest is never deleted"
    monkeypatch.setattr(checkpoint.os, "statvfs", SmallDisk(root, capacity=0))
    assert checkpoint.make_room(root, need=1e15) == (None, [])
    monkeypatch.undo()
    assert checkpoint.free_bytes(tmp_path / "not" / "made" / "yet") > 0  # its nearest parent's


def test_a_checkpoint_write_that_fails_names_the_disk_error(tmp_path):
    """DCP's writer threads fail on a full disk with torch.save's "unexpected pos" raised over
    the OSError: the trainer's error names the OSError and the folder. Here the disk is a
    file-size limit (RLIMIT_FSIZE) of 64 KiB on a 4 MB weight: EFBIG, as real as ENOSPC."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import resource, signal, torch
        from runtime.backends import trainer_state
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        model = torch.nn.Linear(1024, 1024)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        saver = trainer_state.Saver()
        saver.start({str(tmp_path / "step_1")!r}, model, optimizer, scheduler, 1)
        try:
            saver.written(wait=True)
        except OSError as e:
            print("ERRNO", e.errno, e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    ).stdout
    import errno

    line = next(x for x in out.splitlines() if x.startswith("ERRNO"))
    assert line.startswith(f"ERRNO {errno.EFBIG} "), out
    assert f"checkpoint write to {tmp_path / 'step_1' / 'trainer'} failed: File too large" in line
