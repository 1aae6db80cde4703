"""A recipe's references to code of the user's own (`grpo.loss: mypkg.losses:my_loss`, a reward
`mypkg.rewards:exact`): found and checked without importing them, so `validate` answers on a
laptop that has no torch, and the launcher knows which folders to bring to the nodes.

A reference is `module:function`. The module is looked for on the search path (the recipe's
folder, the current directory, then Python's path) by file, without running it; the function
must be defined at its top level (or bound there by an assignment or import, which is not
checked further); a `def` must take the arguments the runtime passes (a loss `(inputs, config)`,
a reward `(prompt, completion, answer)`). An environment (`env.name: mypkg.envs:MyEnv`) is a
class instead, which must derive from an OpenEnv Environment: a base named `...Environment`
(openenv's `Environment`, `MCPEnvironment`), directly or through classes of the same file.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes.errors import UserError
from recipes.names import BUILTIN_REWARDS, LOSSES


@dataclass(frozen=True)
class Reference:
    """One `module:function` of the user's: where the recipe names it, and how it is called."""

    field: str  # e.g. "grpo.loss", "dataset.rewards.0.name"
    spec: str
    arguments: tuple[str, ...]
    kind: str = "function"  # or "environment": a class deriving from an OpenEnv Environment

    @property
    def module(self) -> str:
        return self.spec.partition(":")[0]

    @property
    def function(self) -> str:
        return self.spec.partition(":")[2]


def references(recipe: Any) -> list[Reference]:
    """Every `module:function` the recipe names (an SFT recipe's: its eval.reward)."""
    found: list[Reference] = []
    if recipe.kind == "sft":
        name = recipe.eval.reward
        if name is not None and name not in BUILTIN_REWARDS and not name.startswith("builtin:"):
            found.append(Reference("eval.reward", name, ("prompt", "completion", "answer")))
        return found
    if recipe.grpo.loss not in LOSSES:
        found.append(Reference("grpo.loss", recipe.grpo.loss, ("inputs", "config")))
    for i, reward in enumerate(recipe.dataset.rewards):
        name = reward.name
        if name not in BUILTIN_REWARDS and not name.startswith("builtin:"):
            found.append(
                Reference(f"dataset.rewards.{i}.name", name, ("prompt", "completion", "answer"))
            )
    env = getattr(recipe, "env", None)
    if env is not None and not env.builtin:
        found.append(Reference("env.name", env.name, (), kind="environment"))
    return found


def search_path(recipe_source: str | None = None) -> list[Path]:
    """Where a recipe's modules are looked for: its own folder (when it is a file), the current
    directory, then Python's path."""
    paths = []
    if recipe_source and Path(recipe_source).is_file():
        paths.append(Path(recipe_source).resolve().parent)
    paths.append(Path.cwd())
    paths += [Path(p) for p in sys.path if p]
    return list(dict.fromkeys(paths))


def locate(module: str, paths: Iterable[Path]) -> tuple[Path, Path] | None:
    """(the module's file, the folder on the path its top-level package or module lives in),
    found by file names alone; None when it is nowhere. A folder on the way needs no
    `__init__.py`: Python imports it as a namespace package (`myenvs/lookup.py` is
    `myenvs.lookup`)."""
    parts = module.split(".")
    for root in paths:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, root
    return None


def check(refs: Sequence[Reference], paths: Iterable[Path]) -> dict[str, Path]:
    """Check every reference; the top-level package or module each lives in, by its name (what
    a node needs to import them). Raises UserError (one line) for the first that is wrong."""
    paths = list(paths)
    roots: dict[str, Path] = {}
    for ref in refs:
        where = f"{ref.field} {ref.spec!r}"
        found = locate(ref.module, paths)
        if found is None:
            raise UserError(
                f"{where}: module {ref.module!r} not found (looked in the recipe's folder, the "
                "current directory and the Python path)"
            )
        file, root = found
        if ref.kind == "environment":
            _check_environment(where, file, ref)
        else:
            _check_function(where, file, ref)
        top = ref.module.split(".")[0]
        where_top = root / top if (root / top).is_dir() else root / f"{top}.py"
        if roots.get(top, where_top) != where_top:
            # one name on the nodes' path: a node could import only one of the two
            raise UserError(
                f"{where}: module {top!r} is {where_top}, but another reference's {top!r} is "
                f"{roots[top]}; the nodes can import only one: rename one of them"
            )
        roots[top] = where_top
    return roots


def _parse(where: str, file: Path) -> ast.Module:
    try:
        return ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (OSError, SyntaxError, ValueError) as e:
        raise UserError(f"{where}: cannot read {file}: {e}") from None


def _base_name(base: ast.expr) -> str:
    """`Environment` for `Environment`, `interfaces.Environment` or `MCPEnvironment[...]`."""
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else ""


def _check_environment(where: str, file: Path, ref: Reference) -> None:
    """The class is defined (or bound) at the top level of its file and derives from an OpenEnv
    Environment, directly or through classes defined in the same file."""
    tree = _parse(where, file)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    name, seen = ref.function, set()
    if name not in classes:
        if any(_binds(node, name) for node in tree.body):
            return  # imported or assigned: the runtime checks what it is
        raise UserError(f"{where}: {file.name} has no class {name!r}")
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for base in classes[current].bases:
            base_name = _base_name(base)
            if base_name.endswith("Environment") and base_name not in classes:
                return
            if base_name in classes:
                todo.append(base_name)
    bases = ", ".join(_base_name(b) or "?" for b in classes[name].bases) or "none"
    raise UserError(
        f"{where}: {name} is not an OpenEnv Environment (its bases: {bases}); derive it from "
        "openenv.core.env_server.interfaces.Environment or MCPEnvironment"
    )


def _check_function(where: str, file: Path, ref: Reference) -> None:
    tree = _parse(where, file)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == ref.function:
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            if args.vararg is None and len(positional) != len(ref.arguments):
                have = ", ".join(a.arg for a in positional)
                raise UserError(
                    f"{where}: {ref.function} must take ({', '.join(ref.arguments)}), "
                    f"it takes ({have})"
                )
            return
        if _binds(node, ref.function):
            return  # assigned or imported: found, its arguments are the runtime's to check
    raise UserError(f"{where}: {file.name} has no function {ref.function!r}")


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, ast.Import | ast.ImportFrom):
        return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
    if isinstance(node, ast.ClassDef):
        return node.name == name
    return False
