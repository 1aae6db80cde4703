"""runtime.procs.cpus: the CPU a thread last ran on (/proc), the host's layout (/sys), the specs
that pin a process to CPUs; bench/gpu_grpo.py's --cpus and bench/cpu_runs.py's table."""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.procs import cpus

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import cpu_runs  # noqa: E402
import gpu_grpo  # noqa: E402


def stat_line(comm: str, processor: int) -> str:
    # proc(5): pid (comm) state, then fields 4..52; field 39 is the processor
    fields = [str(n) for n in range(4, 53)]
    fields[39 - 4] = str(processor)
    return f"4242 ({comm}) R " + " ".join(fields) + "\n"


def test_the_processor_field_is_read_after_a_command_with_spaces_and_parentheses(tmp_path):
    task = tmp_path / "77/task/78"
    task.mkdir(parents=True)
    (task / "stat").write_text(stat_line("VLLM::Engine (x) 2", 13))
    assert cpus.thread_cpu(78, pid=77, proc=tmp_path) == 13
    assert cpus.thread_cpu(79, pid=77, proc=tmp_path) is None  # a thread that ended


def test_this_threads_cpu_is_one_it_may_run_on():
    here = cpus.thread_cpu(threading.get_native_id())
    assert here in os.sched_getaffinity(0)


def test_cpu_lists_read_and_fold_as_the_kernel_writes_them():
    assert cpus.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cpus.parse_cpu_list("") == []
    assert cpus.format_cpu_list([11, 0, 1, 2, 5, 10]) == "0-2,5,10-11"
    for bad in ("a", "3-", "5-2", "1;2"):
        with pytest.raises(ValueError, match="CPU list"):
            cpus.parse_cpu_list(bad)


def fake_sys(root: Path, siblings: dict[int, str], nodes: dict[int, str], gpu_node: str) -> None:
    """A /sys of `siblings` (CPU -> its thread_siblings_list), NUMA `nodes` and one GPU at
    0000:18:00.0 on `gpu_node`."""
    cpu_dir = root / "devices/system/cpu"
    for cpu, listed in siblings.items():
        (cpu_dir / f"cpu{cpu}/topology").mkdir(parents=True)
        (cpu_dir / f"cpu{cpu}/topology/thread_siblings_list").write_text(listed + "\n")
    (cpu_dir / "online").write_text(cpus.format_cpu_list(list(siblings)) + "\n")
    for node, listed in nodes.items():
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(listed + "\n")
    gpu = root / "bus/pci/devices/0000:18:00.0"
    gpu.mkdir(parents=True)
    (gpu / "numa_node").write_text(gpu_node + "\n")


# two nodes of two cores each, SMT siblings numbered apart (n, n + 4), as on many hosts
TWO_NODES = {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}


def test_the_layout_groups_siblings_and_finds_the_gpus_node(tmp_path):
    fake_sys(tmp_path, TWO_NODES, {0: "0-1,4-5", 1: "2-3,6-7"}, "1")
    topo = cpus.topology(tmp_path, gpu_bus_id="00000000:18:00.0")
    assert topo.cpus == list(range(8))
    assert topo.cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.nodes == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]} and topo.gpu_node == 1
    assert topo.one_per_core() == [0, 1, 2, 3]
    assert topo.one_per_core([4, 5, 2]) == [2, 4, 5]
    assert topo.node_of(6) == 1
    assert topo.to_dict() == {
        "cpus": "0-7",
        "smt_siblings": ["0,4", "1,5", "2,6", "3,7"],
        "numa_nodes": {"0": "0-1,4-5", "1": "2-3,6-7"},
        "gpu_numa_node": 1,
    }
    allowed = list(range(8))
    assert cpus.resolve("none", topo, allowed) is None
    assert cpus.resolve("node", topo, allowed) == [2, 3, 6, 7]
    assert cpus.resolve("cores", topo, allowed) == [0, 1, 2, 3]
    assert cpus.resolve("node-cores", topo, allowed) == [2, 3]
    assert cpus.resolve("node-cores", topo, [0, 1, 6, 7]) == [6, 7]
    assert cpus.resolve("1,5", topo, allowed) == [1, 5]


def test_a_gpu_without_a_node_is_on_the_only_node_or_unknown(tmp_path):
    one = tmp_path / "one"
    fake_sys(one, {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}, {0: "0-3"}, "-1")
    topo = cpus.topology(one, gpu_bus_id="0000:18:00.0")
    assert topo.gpu_node is None and topo.cores == [[0, 1], [2, 3]]
    assert cpus.resolve("node-cores", topo, [0, 1, 2, 3]) == [0, 2]
    two = tmp_path / "two"
    fake_sys(two, TWO_NODES, {0: "0-1,4-5", 1: "2-3,6-7"}, "-1")
    with pytest.raises(ValueError, match="NUMA node is not known"):
        cpus.resolve("node", cpus.topology(two, gpu_bus_id="0000:18:00.0"), list(range(8)))


def test_specs_the_host_cannot_meet_are_refused_in_one_line(tmp_path):
    fake_sys(tmp_path, TWO_NODES, {0: "0-1,4-5", 1: "2-3,6-7"}, "1")
    topo = cpus.topology(tmp_path, gpu_bus_id="0000:18:00.0")
    for spec, allowed, words in [
        ("9", list(range(8)), "9 not among this process's CPUs (0-7)"),
        ("node", [0, 1], "no CPU of this process's (0-1)"),
        ("fast", list(range(8)), "one of none, node, cores, node-cores or a CPU list"),
    ]:
        with pytest.raises(ValueError) as refused:
            cpus.resolve(spec, topo, allowed)
        assert words in str(refused.value) and "\n" not in str(refused.value)


def test_nvidia_smis_bus_id_names_the_sys_device():
    assert cpus.sysfs_bus("00000000:18:00.0") == "0000:18:00.0"
    assert cpus.sysfs_bus("0000:AB:00.0") == "0000:ab:00.0"


def test_pinning_moves_every_thread_and_the_watch_sees_the_pinned_cpu():
    before = os.sched_getaffinity(0)
    target = min(before)
    started, done = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: (started.set(), done.wait(10)))
    other.start()
    started.wait(5)
    try:
        assert cpus.pin_process([target]) >= 2
        assert os.sched_getaffinity(other.native_id) == {target}
        watch = cpus.CpuWatch([("self", threading.get_native_id())], every_s=0.01)
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:
            pass
        seen = watch.stop()
        (only,) = seen.values()
        assert set(only) == {str(target)} and sum(only.values()) >= 2
        assert watch.moves == {("self", threading.get_native_id()): 0}
    finally:
        done.set()
        other.join()
        cpus.pin_process(sorted(before))
    assert os.sched_getaffinity(0) == before


STAT = """cpu  10 0 10 100 0 0 0 0 0 0
cpu0 100 5 50 1000 7 3 2 4 0 0
cpu1 200 0 20 900 1 0 0 0 0 0
intr 12345
"""


def test_proc_stat_gives_each_cpus_busy_interrupt_and_stolen_seconds():
    before = cpus.cpu_ticks(STAT)
    assert set(before) == {0, 1} and before[0]["steal"] == 4 and before[0]["softirq"] == 2
    after = cpus.cpu_ticks(
        STAT.replace("cpu0 100 5 50 1000 7 3 2 4", "cpu0 150 5 60 1010 9 5 6 24")
    )
    tick = os.sysconf("SC_CLK_TCK")
    seconds = cpus.cpu_seconds(before, after)
    # busy: user 50 + system 10 + irq 2 + softirq 4 + steal 20 (idle and iowait left out)
    assert seconds[0] == {"busy_s": 86 / tick, "irq_s": 6 / tick, "steal_s": 20 / tick}
    assert seconds[1] == {"busy_s": 0.0, "irq_s": 0.0, "steal_s": 0.0}


def test_the_watch_counts_a_move_between_cpus(tmp_path):
    task = tmp_path / "5/task/6"
    task.mkdir(parents=True)
    (task / "stat").write_text(stat_line("python", 2))
    (tmp_path / "stat").write_text(STAT)
    watch = cpus.CpuWatch([(5, 6)], every_s=3600, proc=tmp_path)  # the first sample: CPU 2
    (task / "stat").write_text(stat_line("python", 9))
    (tmp_path / "stat").write_text(
        STAT.replace("cpu1 200 0 20 900 1 0 0 0", "cpu1 200 0 20 900 1 0 0 50")
    )
    seen = watch.stop()  # and one more as it stops
    assert seen == {"5/6": {"2": 1, "9": 1}} and watch.moves[(5, 6)] == 1
    # stolen from CPU 1 meanwhile: the thread was never seen there
    assert watch.seconds[1]["steal_s"] == 50 / os.sysconf("SC_CLK_TCK")
    assert watch.stolen_s() == 0.0


def test_the_benchs_cpus_option_takes_words_and_lists_and_refuses_the_rest():
    assert gpu_grpo.cpu_spec("node-cores") == "node-cores"
    assert gpu_grpo.cpu_spec(" 0-3,8 ") == "0-3,8"
    for bad in ("fast", "3-1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="one of none, node"):
            gpu_grpo.cpu_spec(bad)


def test_the_table_lists_each_processs_calls_and_the_sweep():
    placement = {
        "python_hash_seed": "1",
        "cpus_spec": "none",
        "affinity": "0-3",
        "topology": {"cpus": "0-3", "smt_siblings": ["0,2", "1,3"], "numa_nodes": {"0": "0-3"},
                     "gpu_numa_node": None},
    }  # fmt: skip
    result = {
        "device": {"name": "H200"},
        "cpus_1_none": {
            "cpu_placement": placement,
            "calls_list": [
                {"s": 2.54, "cpus_seen": {"3": 50, "1": 2}, "steal_s": 0.02, "host_steal_s": 0.5},
                {"s": 3.3, "cpus_seen": {}},
            ],
        },
        "cpus_2_sweep": {
            "cpu_placement": {**placement, "cpus_spec": "none"},
            "calls_list": [{"s": 2.5, "cpus_seen": {"1/1": {"0": 4}, "1/9": {"2": 1}}}],
            "cpu_sweep": [{"cpu": 0, "s": 2.51}, {"cpu": 1, "s": 3.31}],
        },
        "cpus_3_cores": {"cpu_placement": placement},
    }
    table = cpu_runs.markdown(result)
    assert "| cpus_1_none | 1 | none | 0-3 | 2.54 | 3 (50), 1 (2) | 0.02 of 0.50 |" in table
    assert "|  |  |  |  | 3.30 | - | - |" in table
    assert "| 2.50 | 1/1: 0 (4); 1/9: 2 (1) |" in table
    assert "| cpus_2_sweep | 1 | 3.31 | - |" in table
    assert "| cpus_3_cores | - | - | - | no call | - |" in table
    assert "SMT siblings 0,2 1,3; NUMA nodes {'0': '0-3'}; the GPU's node None" in table


def test_the_tables_script_refuses_a_missing_file_in_one_line(tmp_path, capsys):
    assert cpu_runs.main([str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.strip() == f"cpu_runs.py: no {tmp_path / 'none.json'}"


def test_a_bad_cpus_option_stops_the_bench_before_anything_starts(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu_grpo.py"), "vllm", "--cpus", "fast",
         "--out", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "argument --cpus: not a CPU list: 'fast'" in run.stderr
    assert not (tmp_path / "out.json").exists()


def device_run_cpus(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts/gpu/device_run.sh"), "cpus", "--dry-run", *args],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "OUT": str(tmp_path / "out"), "TAG": "_t", **env},
    )  # fmt: skip


def test_device_runs_cpus_mode_starts_a_process_a_run_and_refuses_unknown_words(tmp_path):
    # the default: three unpinned processes of six calls, each call beside the speed probe
    default = device_run_cpus(tmp_path)
    assert default.returncode == 0, default.stderr
    names = [
        line.split(",")[0] for line in default.stdout.splitlines() if line.startswith("cpus: ")
    ]
    assert names == [f"cpus: cpus_{i}_none" for i in (1, 2, 3)]
    assert default.stdout.count("--speed-probe") == 3
    assert "--section cpus_1_none --calls 6 --cpus none" in default.stdout
    words = "none sweep none sweep node-cores"
    run = device_run_cpus(tmp_path, "--engine", "separate", CPUS_RUNS=words, CPUS_CALLS="4")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    names = [line.split(",")[0] for line in lines if line.startswith("cpus: ")]
    order = ("1_none", "2_sweep", "3_none", "4_sweep", "5_node-cores")
    assert names == [f"cpus: cpus_{i}" for i in order]
    commands = [line.strip() for line in lines if line.startswith("  ")]
    assert all("bench/gpu_grpo.py vllm --calls-only --speed-probe --out "
               "/tmp/bench/gpu_grpo_cpus_t.json" in c and c.endswith("--engine separate")
               for c in commands)  # fmt: skip
    assert "--section cpus_1_none --calls 4 --cpus none" in commands[0]
    assert [" ".join(c.split()[:2]) for c in commands] == [
        f"env PYTHONHASHSEED={i}" for i in range(1, 6)
    ]
    assert "timeout -s TERM -k 20 120 " in commands[0]
    # the sweep: one call, then one a CPU, in a limit 4 s a CPU longer
    assert f"timeout -s TERM -k 20 {120 + 4 * len(os.sched_getaffinity(0))} " in commands[1]
    assert "--section cpus_2_sweep --calls 1 --cpu-sweep" in commands[1]
    assert "--cpu-sweep" in commands[3] and "--cpus node-cores" in commands[4]
    picked = device_run_cpus(tmp_path, CPUS_RUNS="0-3 cores", CPUS_CALLS="2", CPUS_RUN_S="90")
    assert "timeout -s TERM -k 20 90 " in picked.stdout
    assert "--section cpus_1_0-3 --calls 2 --cpus 0-3" in picked.stdout
    assert "--section cpus_2_cores --calls 2 --cpus cores" in picked.stdout
    # no process runs past CPUS_BY (a dry run's take no time): each in what is left, and none
    # with less than 90 s
    soon = device_run_cpus(tmp_path, CPUS_BY=str(int(time.time()) + 100))
    limits = [int(c.split()[0]) for c in soon.stdout.split("timeout -s TERM -k 20 ")[1:]]
    assert len(limits) == 3 and all(95 <= s <= 100 for s in limits), soon.stdout
    late = device_run_cpus(tmp_path, CPUS_BY=str(int(time.time()) + 30))
    assert "cpus_1_none not started" in late.stdout and "timeout" not in late.stdout
    bad = device_run_cpus(tmp_path, CPUS_RUNS="none fast")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "cpus: fast in CPUS_RUNS: none, node, cores, node-cores, " \
        "sweep or a CPU list"  # fmt: skip
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


class BusyEngine:
    """vLLM's place in `gpu_grpo.py vllm` on a machine without a GPU: each generate call keeps
    the calling thread busy (as vLLM's engine steps keep it, in this process) for 30 ms."""

    def __init__(self, spec, **kwargs) -> None:
        self.init_seconds, self.logprobs_mode, self.tensor_parallel_size = 0.0, "raw", 1
        self.closed = False

    def generate(self, prompts, n, max_new_tokens, temperature, top_p, seed):
        end = time.perf_counter() + 0.03
        while time.perf_counter() < end:
            pass
        return [
            SimpleNamespace(response_ids=[1] * max_new_tokens) for _ in prompts for _ in range(n)
        ]

    def close(self) -> None:
        self.closed = True


def test_the_vllm_bench_lists_each_call_with_its_cpus_pinned_and_swept(monkeypatch):
    from runtime.backends import vllm_generator

    monkeypatch.setattr(vllm_generator, "VLLMGenerator", BusyEngine)
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # as device_run.sh cpus sets it, a process each
    before = os.sched_getaffinity(0)
    first = min(before)
    args = argparse.Namespace(
        recipe="qwen3-1.7b", response_tokens=8, calls=2, engine="in-process", cpus=str(first),
        cpu_sweep=True, calls_only=True, py_spy=None, tag="", speed_probe=True,
    )  # fmt: skip
    try:
        section = gpu_grpo.run_vllm(args)
        pinned = os.sched_getaffinity(0)
    finally:
        cpus.pin_process(sorted(before))
    assert pinned == {first}
    placement = section["cpu_placement"]
    assert placement["cpus_spec"] == str(first) and placement["affinity"] == str(first)
    assert placement["topology"]["cpus"] == cpus.format_cpu_list(cpus.topology().cpus)
    calls = section["calls_list"]
    assert len(calls) == 2 and section["call_s"] == pytest.approx(sum(c["s"] for c in calls) / 2)
    for call in calls:
        assert call["s"] >= 0.03 and call["tokens"] == 16 * 8 * 8
        assert call["cpus_seen"] and set(call["cpus_seen"]) == {str(first)}
        assert call["cpu_moves"] == 0 and call["cpu_s"] > 0
        # the pinned CPU's seconds meanwhile (busy, interrupts, stolen) and the steal
        assert list(call["cpu_seconds"]) == [str(first)]
        assert call["cpu_seconds"][str(first)]["busy_s"] >= 0
        assert 0 <= call["steal_s"] <= call["host_steal_s"]
        # the process's garbage collection and the probe beside the call, sampled or not
        assert call["gc_s"] >= 0 and call["gc_collections"] >= 0
        assert "probe_mb_per_s" in call and call["probe_samples"] >= 0
    # the sweep: one call a CPU of the process's (here the one it was pinned to)
    assert [row["cpu"] for row in section["cpu_sweep"]] == [first]
    assert set(section["cpu_sweep"][0]["cpus_seen"]) == {str(first)}
    assert (
        "load_weights_from_cpu_s" not in section and section["tokens_per_s_512_sequences"] is None
    )
    table = cpu_runs.markdown({"cpus_1_sweep": section})
    assert f"| cpus_1_sweep | 7 | {first} | {first} |" in table


def test_the_gc_clock_counts_collections_and_lets_go_of_the_callback():
    clock = cpus.GcClock()
    for _ in range(3):
        ring = [[]]
        ring[0].append(ring)  # a cycle only the collector frees
        del ring
        gc.collect()
    got = clock.stop()
    assert got["gc_collections"] >= 3 and got["gc_gen2_s"] > 0 and got["gc_s"] >= got["gc_gen2_s"]
    assert clock._on_gc not in gc.callbacks
    gc.collect()
    assert clock.stop()["gc_collections"] == got["gc_collections"]  # no longer counting


def test_the_speed_probe_reports_the_pace_of_a_cpu_and_ends_its_process():
    probe = cpus.SpeedProbe(every_s=0.02, repeat=1)
    deadline = time.monotonic() + 10
    # its interpreter's start on a busy 2-core runner: wait for a few samples' worth of time
    time.sleep(0.5)
    got = probe.stop()
    while got["probe_samples"] == 0 and time.monotonic() < deadline:  # started too late: again
        probe = cpus.SpeedProbe(every_s=0.02, repeat=1)
        time.sleep(1.0)
        got = probe.stop()
    assert got["probe_samples"] >= 1, got
    assert 0 < got["probe_mb_per_s_min"] <= got["probe_mb_per_s"] <= got["probe_mb_per_s_max"]
    assert probe._proc.poll() is not None  # the child is gone
