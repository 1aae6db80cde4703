"""The outputs the README and docs/commands.md show are what the commands print today: each
fenced block that starts with `$ forgesky ...` is run (in process, with the committed price
snapshot), and its lines must be lines of the output, a run of them between each `...`, in
order. A block that starts with `run: ` continues the nearest `$ forgesky plan` block above it.
The planner, the cost model and the prices change; their examples then fail here, not in a
reader's hands."""

from __future__ import annotations

import shlex

import pytest
from runtime_helpers import ROOT

from launcher.cli import main

FILES = ("README.md", "docs/commands.md")


def blocks(text: str) -> list[list[str]]:
    out: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                out.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return out


def examples(name: str) -> list[tuple[str, list[str]]]:
    """(command, shown lines) of each checkable block of `name`."""
    found: list[tuple[str, list[str]]] = []
    last_plan = None
    for block in blocks((ROOT / name).read_text()):
        if block and block[0].startswith("$ forgesky "):
            command = block[0][2:]
            if command.startswith("forgesky plan "):
                last_plan = command
            found.append((command, block[1:]))
        elif block and block[0].startswith("run: ") and last_plan:
            found.append((last_plan, block))
    return found


CASES = [(name, cmd, shown) for name in FILES for cmd, shown in examples(name)]


def test_the_files_have_examples_to_check():
    assert {name for name, _, _ in CASES} == set(FILES)
    assert sum(cmd.startswith("forgesky plan") for _, cmd, _ in CASES) >= 5


def segments(shown: list[str]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for line in shown:
        if line.strip() == "...":
            parts.append([])
        else:
            parts[-1].append(line.rstrip())
    return [p for p in parts if p]


@pytest.mark.parametrize(("name", "command", "shown"), CASES, ids=[f"{n}:{c}" for n, c, _ in CASES])
def test_a_shown_output_is_what_the_command_prints(name, command, shown, capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    code = main(shlex.split(command)[1:])
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert code == 0, command
    at = 0
    for part in segments(shown):
        for start in range(at, len(printed) - len(part) + 1):
            if printed[start : start + len(part)] == part:
                at = start + len(part)
                break
        else:
            first_off = next(
                (line for line in part if line not in printed), "(the lines, not in this order)"
            )
            raise AssertionError(f"{name}: `{command}` no longer prints: {first_off}")


# Placeholders the docs write in commands, and a value of the kind each stands for.
PLACEHOLDERS = {"N": "2", "M": "1", "NAME": "tiny", "RUN_DIR": "runs/x", "SOURCE": "runs/x"}


def written_commands() -> list[tuple[str, str]]:
    """(file, command) for each `forgesky COMMAND ...` the README and docs/ write, inline or on
    a line of its own, with arguments: what a reader copies. A bare `forgesky plan` names the
    command, and a line with `[...]`, `<...>` or `·` is a pattern, not a command."""
    import re

    from launcher.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        spans = re.findall(r"`([^`\n]+)`", text)
        spans += [line.strip().removeprefix("$ ") for line in text.splitlines()]
        for span in spans:
            words = span.split(" # ")[0].split()
            if len(words) < 3 or words[0] != "forgesky" or words[1] not in commands:
                continue
            if any(mark in span for mark in ("[", "<", "·", "...")):
                continue
            found.append((path.name, " ".join(words)))
    return sorted(set(found))


WRITTEN = written_commands()


def test_the_docs_write_commands_to_check():
    assert len(WRITTEN) >= 30 and {"README.md", "commands.md"} <= {f for f, _ in WRITTEN}


@pytest.mark.parametrize(("name", "command"), WRITTEN, ids=[f"{n}:{c}" for n, c in WRITTEN])
def test_a_command_the_docs_write_is_one_the_cli_takes(name, command, capsys):
    """Parsed, not run (some launch): a flag renamed, a value of the wrong kind or two values
    after one `--set` fail here."""
    from launcher.cli import build_parser

    argv = [PLACEHOLDERS.get(w, w) for w in shlex.split(command)[1:]]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"{name}: `{command}`: {capsys.readouterr().err.strip()}"


def _runs_here(command: str) -> bool:
    """A written command that only reads the catalog and prints: run, not only parsed."""
    words = command.split()
    return (
        words[1] in ("plan", "show", "render")
        and words[2] != "NAME"
        and not words[2].endswith(".yaml")
        and "-o" not in words
    )


RUNNABLE = [(n, c) for n, c in WRITTEN if _runs_here(c)]


@pytest.mark.parametrize(("name", "command"), RUNNABLE, ids=[f"{n}:{c}" for n, c in RUNNABLE])
def test_a_plan_the_docs_write_plans(name, command, capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    code = main(shlex.split(command)[1:])
    assert code == 0, f"{name}: `{command}`: {capsys.readouterr().err.strip()}"
