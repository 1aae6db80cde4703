"""Where the CPU goes while a bench measures: py-spy's stacks of every process of a run.

`StackRecorder` runs `py-spy record` on a process and its descendants (a run's controller and
its Monarch procs) without pausing them (`--nonblocking`), one line per distinct stack in
py-spy's raw format; `summarize` reads that file back:

- for each process, its role (the service whose actor module its stacks pass through: generator,
  trainer, reference, reward; the controller otherwise) and, for each thread, the share of the
  window it was on the CPU (py-spy leaves idle threads out: samples / (rate x seconds));
- for the generator's busiest thread (the one running vLLM's engine steps), the functions its
  samples inside a generate call passed through (inclusive) and the ones they ended in (self),
  as CPU seconds (samples / rate) and as shares of those samples.

Comparing those figures for the in-loop generator and for vLLM alone tells a thread that does
more work from one that does the same work more slowly.

    python bench/stacks.py FILE[.gz] --rate 100 --seconds 20   # a raw file's summary, as JSON
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# by priority: a process's role is the first whose path one of its stacks passes through (vLLM
# alone, in the bench's own process, counts as a generator)
ROLES = {
    "runtime/actors/generator.py": "generator",
    "runtime/actors/trainer.py": "trainer",
    "runtime/actors/reference.py": "reference",
    "runtime/actors/reward.py": "reward",
    "runtime/backends/vllm_generator.py": "generator",
    "runtime/control/": "controller",
}
# the generator backend's call: the engine's samples are those under it
ENGINE_CALL = "VLLMGenerator.generate"
_TAIL = re.compile(r" (\d+)$")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


class StackRecorder:
    """`py-spy record` on `pid` and its descendants, from `start()` until `stop()`; the raw file
    is kept gzipped at `out` (`.txt.gz`), py-spy's own output in a temporary folder."""

    def __init__(self, out: Path, rate: int = 100) -> None:
        self.out, self.rate = out, rate
        self.started: float | None = None
        self.seconds: float | None = None
        self.error: str | None = None
        self.text: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="forgesky-stacks-"))

    def start(self, pid: int) -> None:
        beside = Path(sys.executable).with_name("py-spy")  # a venv's, not on PATH
        exe = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
        if exe is None:
            self.error = "py-spy is not installed"
            return
        cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--threads",
               "--rate", str(self.rate), "--format", "raw",
               "--output", str(self._tmp / "raw.txt")]  # fmt: skip
        with (self._tmp / "py-spy.log").open("wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.started = time.perf_counter()

    def stop(self) -> None:
        proc = self._proc
        if proc is None or self.started is None:
            return
        self._proc = None
        self.seconds = time.perf_counter() - self.started
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raw = self._tmp / "raw.txt"
        if not raw.exists():
            log = (self._tmp / "py-spy.log").read_text(errors="replace").strip().splitlines()
            self.error = f"py-spy exited {proc.returncode} without output: {' '.join(log[-1:])}"
        else:
            self.text = raw.read_text(errors="replace")
            self.out.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(self.out, "wt") as f:
                f.write(self.text)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def summary(self) -> dict[str, Any]:
        if self.error is not None or self.seconds is None or self.text is None:
            return {"error": self.error or "not recorded"}
        return {"file": self.out.name, **summarize(self.text, self.rate, self.seconds)}


def parse(text: str) -> list[tuple[str, str, list[str], int]]:
    """py-spy raw lines as (process, thread, frames outermost first, samples). A process's
    command line may hold newlines: a line without a trailing count continues on the next."""
    rows, pending = [], ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        tail = _TAIL.search(pending)
        if tail is None:
            continue
        stack, count = pending[: tail.start()], int(tail.group(1))
        pending = ""
        process, thread, frames = "", "", []
        for part in _split(stack):
            if part.startswith("process ") and not frames and not thread:
                process = part  # the innermost process (the run's procs are descendants)
            elif part.startswith("thread ") and not frames:
                thread = part
            else:
                frames.append(part)
        rows.append((process, thread, frames, count))
    return rows


def _split(stack: str) -> list[str]:
    """Frames split at ';' outside a process's quoted command line."""
    parts, current, quoted = [], [], False
    for ch in stack:
        if ch == '"':
            quoted = not quoted
        if ch == ";" and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p for p in parts if p]


def role_of(frames: list[str]) -> str | None:
    for path, role in ROLES.items():
        if any(path in frame for frame in frames):
            return role
    return None


def function(frame: str) -> str:
    """`name (path:line)` as `name (file)`: one entry for every line of a function."""
    m = _FRAME.match(frame)
    if m is None:
        return frame
    return f"{m['func']} ({Path(m['file']).name})"


def summarize(text: str, rate: int, seconds: float, top: int = 25) -> dict[str, Any]:
    rows = parse(text)
    window = rate * seconds
    procs: dict[str, dict[str, Any]] = {}
    for process, thread, frames, count in rows:
        p = procs.setdefault(process, {"roles": set(), "threads": Counter(), "rows": []})
        role = role_of(frames)
        if role is not None:
            p["roles"].add(role)
        p["threads"][thread] += count
        p["rows"].append((thread, frames, count))
    out: list[dict[str, Any]] = []
    engine: dict[str, Any] | None = None
    for process, p in procs.items():
        role = next((r for r in dict.fromkeys(ROLES.values()) if r in p["roles"]), "other")
        pid = re.match(r"process (\d+)", process)
        threads = [
            {"thread": t, "samples": n, "on_cpu_share": round(n / window, 3)}
            for t, n in p["threads"].most_common()
        ]
        out.append({
            "role": role, "pid": int(pid.group(1)) if pid else None,
            "samples": sum(p["threads"].values()),
            "on_cpu_cores": round(sum(p["threads"].values()) / window, 2),
            "threads": threads[:8],
        })  # fmt: skip
        if role == "generator" and (engine is None or threads[0]["samples"] > engine["samples"]):
            engine = _functions(p["rows"], threads[0]["thread"], rate, window, top)
    out.sort(key=lambda p: -p["samples"])
    return {"rate_hz": rate, "seconds": round(seconds, 2), "processes": out,
            "generator_engine_thread": engine}  # fmt: skip


def _functions(
    rows: list[tuple[str, list[str], int]], thread: str, rate: int, window: float, top: int
) -> dict[str, Any]:
    """The thread's samples inside a generate call (`ENGINE_CALL`; all of them where none is),
    by function: inclusive and self, as CPU seconds (samples / rate) and shares of the calls'."""
    mine = [(frames, n) for t, frames, n in rows if t == thread and frames]
    inside = [(f, n) for f, n in mine if any(ENGINE_CALL in x for x in f)]
    kept = inside or mine
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for frames, count in kept:
        for name in {function(f) for f in frames}:
            inclusive[name] += count
        own[function(frames[-1])] += count
    total = sum(n for _, n in kept)
    samples = sum(n for _, n in mine)

    def listed(counts: Counter[str]) -> list[list[Any]]:
        return [[n, round(c / rate, 3), round(c / total, 4)] for n, c in counts.most_common(top)]

    return {
        "thread": thread,
        "samples": samples,
        "on_cpu_share": round(samples / window, 3),
        "within": ENGINE_CALL if inside else None,
        "within_cpu_s": round(total / rate, 3),
        "columns": ["function", "cpu_s", "share"],
        "inclusive": listed(inclusive),
        "self": listed(own),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path)
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--seconds", type=float, required=True)
    args = p.parse_args()
    opened = gzip.open if args.file.suffix == ".gz" else open
    with opened(args.file, "rt", errors="replace") as f:
        text = f.read()
    print(json.dumps(summarize(text, args.rate, args.seconds), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
