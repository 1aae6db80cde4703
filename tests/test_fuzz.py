"""Every input gets an answer: whatever a recipe file or the command line holds, the pure
commands (recipes, show, plan, validate, render's planning) end with exit 0, or exit 2 and one
line on stderr, never a traceback, and at once (the bound catches a hang, not a slow path)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.cli import main
from recipes import list_recipes
from recipes.loader import catalog_path

HANG_BOUND_S = 1.0
CATALOG = {name: yaml.safe_load(catalog_path(name).read_text()) for name in list_recipes()}

texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\t", "\n", "  \u3000 ", "qwen3", "builtin:", "builtin:tiny", "a:b"]),
    st.text(alphabet=st.characters(categories=["Zs", "Cc", "So", "Lo"]), max_size=8),
)
numbers = st.one_of(
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**100, 0.5, 1e-300]),
)
values = st.recursive(
    st.one_of(texts, numbers, st.booleans(), st.none()),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=6,
)


def paths(data, prefix=()):
    """Every dotted path of a nested recipe dict (lists indexed)."""
    yield prefix
    if isinstance(data, dict):
        for key, value in data.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from paths(value, (*prefix, i))


@st.composite
def mutated_recipes(draw):
    data = copy.deepcopy(CATALOG[draw(st.sampled_from(sorted(CATALOG)))])
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([p for p in paths(data) if p]))
        node = data
        for part in where[:-1]:
            node = node[part]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "delete" and isinstance(node, dict):
            node.pop(where[-1], None)
        elif action == "add" and isinstance(node, dict):
            node[draw(texts)] = draw(values)
        else:
            node[where[-1]] = draw(values)
    return data


def answer(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run forgesky in-process: exit code, stdout, stderr; an exception escaping is a bug."""
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 2
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert elapsed < HANG_BOUND_S, (argv, elapsed)
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("forgesky"), (argv, err)
    return code, out, err


# 150 examples each in the suite; the "deep" profile (tests/conftest.py) runs many more.
FUZZ = settings(
    max_examples=max(150, settings().max_examples),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(data=mutated_recipes(), gpus=st.one_of(st.none(), st.integers(-5, 10**6)))
def test_any_recipe_file_gets_an_answer(tmp_path: Path, capsys, data, gpus):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    extra = [] if gpus is None else ["--gpus", str(gpus)]
    answer(["validate", str(path), *extra], capsys)
    answer(["plan", str(path), *extra], capsys)


@FUZZ
@given(text=st.text(max_size=300))
def test_any_yaml_text_gets_an_answer(tmp_path: Path, capsys, text):
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8")
    answer(["validate", str(path)], capsys)


@FUZZ
@given(
    command=st.sampled_from(["show", "plan", "validate", "cp"]),
    name=st.one_of(texts, st.sampled_from(sorted(CATALOG))),
    gpus=st.one_of(st.none(), texts, st.integers(-(10**20), 10**20).map(str)),
    sets=st.lists(st.tuples(texts, texts), max_size=2),
)
def test_any_command_line_gets_an_answer(tmp_path: Path, capsys, command, name, gpus, sets):
    argv = [command, name]
    if command == "cp":
        argv.append(str(tmp_path / "copy.yaml"))
        argv.append("--force")
    elif gpus is not None:
        argv += ["--gpus", gpus]
    for key, value in sets:
        if command != "show":
            argv += ["--set", f"{key}={value}"]
    answer(argv, capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "qwen3-8b", "--gpus", "99999999999999999999999"],
        ["plan", "qwen3-8b", "--gpus", "-3"],
        ["plan", " "],
        ["plan", ""],
        ["show", "\u00e9\u00e9"],
        ["plan", "qwen3-8b", "--set", "model.hf_id= "],
        ["plan", "qwen3-8b", "--set", "name=   "],
        ["plan", "qwen3-8b", "--set", "grpo.steps=1e400"],
        ["plan", "qwen3-8b", "--set", "grpo.group_size=99999999999999999999"],
        ["plan", "qwen3-8b", "--gpus-per-node", "0"],
        ["plan", "qwen3-8b", "--gpus", "abc"],
        ["recipes", "--bogus"],
    ],
)
def test_absurd_inputs_are_one_line_exit_2(argv, capsys):
    code, _, _ = answer(argv, capsys)
    assert code == 2


@pytest.mark.parametrize("field", ["name", "model.hf_id", "model.size", "dataset.path"])
@pytest.mark.parametrize("blank", ["", " ", "\t "])
def test_blank_identifiers_are_refused(field, blank, capsys):
    code, _, err = answer(["validate", "qwen3-1.7b", "--set", f"{field}={blank}"], capsys)
    assert code == 2 and field in err
