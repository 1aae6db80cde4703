"""Finding, reading and editing recipes: catalog names, YAML files, `key=value` overrides.

Every failure a user can cause becomes a one-line `UserError` naming the file and field.
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from recipes.errors import UserError
from recipes.files import anchor
from recipes.schema import Recipe
from recipes.sft import SftRecipe

CATALOG_DIR = Path(__file__).parent / "catalog"

# Error types whose pydantic message already says what the value was.
_SELF_DESCRIBING = {
    "missing",
    "extra_forbidden",
    "recipe",
    "reward_name",
    "template",
    "builtin",
    "blank",
    "loss_name",
    "share",
    "positive",
    "clip",
    "lora",
}


def list_recipes() -> list[str]:
    """Names of the recipes in the catalog, sorted."""
    return sorted(p.stem for p in CATALOG_DIR.glob("*.yaml"))


def catalog_path(name: str) -> Path:
    """The YAML file of catalog recipe `name` (what `forgesky cp` copies)."""
    path = CATALOG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(_unknown_recipe_message(name))
    return path


def load_recipe(name_or_path: str | os.PathLike[str]) -> Recipe | SftRecipe:
    """A validated recipe (GRPO or SFT) from a catalog name ("qwen3-8b") or a YAML file path."""
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(text)
        if path.is_dir():
            raise UserError(f"{text} is a folder; name a recipe file in it or a catalog recipe")
        if not path.is_file():
            hint = ""
            if Path(text).stem in list_recipes() and "/" not in text:
                hint = f" (catalog names have no .yaml: try {Path(text).stem})"
            raise UserError(f"recipe file not found: {text}{hint}")
    else:
        path = catalog_path(text)
    return _load_file(path)


def validate_recipe(data: Any, source: str) -> Recipe | SftRecipe:
    """A `Recipe` (GRPO) or `SftRecipe` from plain data, by the section it trains with (`grpo`
    or `sft`), or a `UserError` prefixed with `source` (a file, say)."""
    if not isinstance(data, dict):
        kind = "nothing" if data is None else type(data).__name__
        raise UserError(f"{source}: expected a mapping of recipe sections, got {kind}")
    if "grpo" in data and "sft" in data:
        raise UserError(
            f"{source}: a recipe trains by grpo or by sft, not both; keep one of the two sections"
        )
    root = recipe_class(data)
    try:
        return root.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{source}: {_describe(e, root)}") from None


def recipe_class(data: dict[str, Any]) -> type[Recipe] | type[SftRecipe]:
    """The recipe class plain recipe data validates as: SFT where it has an `sft` section."""
    return SftRecipe if "sft" in data else Recipe


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """`recipe` with each "dotted.key=value" applied (values parsed as YAML), re-validated."""
    if not overrides:
        return recipe
    data = recipe.model_dump()
    root = type(recipe)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            example = f"{recipe.kind}.steps=20"  # a key of this recipe's kind (grpo or sft)
            raise UserError(f"override '{item}' must look like KEY=VALUE, e.g. {example}")
        parts = key.strip().split(".")
        parent, last, current = _walk(data, parts, root)
        value = _parse_value(item, raw, current, _kinds_at(parts, root))
        optional = value is None and _section_at(parts, root)[1]  # model.lora=null: LoRA off
        if isinstance(current, dict) and not isinstance(value, dict) and not optional:
            first = next(iter(current), "KEY")
            raise UserError(
                f"override '{item}': {key.strip()} is a section; set its keys, e.g. "
                f"{key.strip()}.{first}=..."
            )
        parent[last] = value
    return validate_recipe(data, f"{recipe.name} with {' '.join(overrides)}")


def _load_file(path: Path) -> Recipe:
    source = _display(path)
    try:
        data = yaml.load(path.read_text(), Loader=_RecipeLoader)
    except yaml.YAMLError as e:
        raise UserError(f"{source}{_yaml_position(e)}: {_yaml_problem(e)}") from None
    except OSError as e:
        raise UserError(f"cannot read recipe {source}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"{source}: not a YAML text file (byte {e.start} is not UTF-8: {e.object[e.start]:#04x})"
        ) from None
    # A relative data or model path in a file is relative to that file first (recipes.files).
    return validate_recipe(anchor(data, path.resolve().parent), source)


def _walk(data: dict[str, Any], parts: list[str], root: type[BaseModel]) -> tuple[Any, Any, Any]:
    """(container, key, current value) for a dotted path, checking every step exists. An
    optional section the recipe leaves out (null, as model.lora) is a section with no keys set
    yet: `model.lora.rank=16` sets one."""
    node: Any = data
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the top level"
        if isinstance(node, dict):
            if part not in node:
                section = _section_at(parts[:depth], root)[0]
                valid = sorted(section.model_fields if section else node)
                if part not in valid:
                    meant = _did_you_mean(part, valid)
                    raise UserError(
                        f"unknown key '{'.'.join(parts)}'; {meant}valid keys under {where}: "
                        + ", ".join(valid)
                    )
                node[part] = None
            key: Any = part
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserError(
                    f"unknown key '{'.'.join(parts)}': {where} is a list of {len(node)}; "
                    f"use an index 0..{len(node) - 1}"
                )
            key = int(part)
        else:
            raise UserError(f"unknown key '{'.'.join(parts)}': {where} is a value, not a section")
        if depth == len(parts) - 1:
            return node, key, node[key]
        if node[key] is None and _section_at(parts[: depth + 1], root)[0] is not None:
            node[key] = {}
        node = node[key]
    raise AssertionError("unreachable: parts is never empty")


def _section_at(parts: list[str], root: type[BaseModel]) -> tuple[type[BaseModel] | None, bool]:
    """The section a dotted path of a `root` recipe names (None where it names a value, or
    nothing known), and whether the recipe may leave it out (null)."""
    kinds = _kinds_at(parts, root)
    return _section_of(kinds), type(None) in kinds


def _kinds_at(parts: list[str], root: type[BaseModel]) -> list[Any]:
    """The types the field at a dotted path of a `root` recipe may hold ([] where none is
    known)."""
    model: type[BaseModel] | None = root
    kinds: list[Any] = [root]
    for part in parts:
        if part.isdigit():
            continue  # an item of a list: the list's own section
        if model is None or part not in model.model_fields:
            return []
        kinds = _kinds(model.model_fields[part].annotation)
        model = _section_of(kinds)
    return kinds


def _section_of(kinds: list[Any]) -> type[BaseModel] | None:
    return next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)


def _kinds(annotation: Any) -> list[Any]:
    """`annotation` and every type inside it (the members of a union, a list's items)."""
    inner = [k for arg in typing.get_args(annotation) for k in _kinds(arg)]
    return [annotation, *inner]


def _parse_value(item: str, raw: str, current: Any, kinds: list[Any]) -> Any:
    # A string field keeps the text as typed: YAML would turn "dataset.config=1" into an int.
    # One that may also hold a list (model.lora.targets: all-linear or [q_proj, v_proj]) reads
    # YAML.
    # One that may be unset (eval.reward: a name or none) reads null (or ~) as unset.
    if isinstance(current, str) and not any(typing.get_origin(k) is list for k in kinds):
        if raw.strip() in ("null", "~") and type(None) in kinds:
            return None
        return raw
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise UserError(f"override '{item}': value is not valid YAML") from None


def _describe(err: ValidationError, root: type[BaseModel]) -> str:
    # an unknown key first: a misspelt key is also the "missing" one it was meant to be
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        fields = _fields_at(first["loc"][:-1], root)
        meant = _did_you_mean(str(first["loc"][-1]), fields)
        msg = f"{loc}: unknown key; {meant}valid keys here: {', '.join(fields)}"
    elif kind == "missing":
        msg = f"{loc}: required field is missing"
    elif not loc:
        msg = first["msg"]
    else:
        msg = f"{loc}: {first['msg']}"
    if kind not in _SELF_DESCRIBING:
        msg += " (got no value)" if first["input"] is None else f" (got {first['input']!r})"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more)"
    return msg


def _did_you_mean(word: str, choices: list[str]) -> str:
    """ "did you mean steps? " for the choice closest to a mistyped key, else "" """

    same_but_case = [c for c in choices if c.lower() == word.lower()]
    close = same_but_case or difflib.get_close_matches(word, choices, n=1)
    return f"did you mean {close[0]}? " if close else ""


def _fields_at(loc: tuple[Any, ...], root: type[BaseModel]) -> list[str]:
    """Field names of the model that sits at `loc` inside a `root` recipe."""
    model: type[BaseModel] = root
    for part in loc:
        if isinstance(part, int):
            continue
        annotation = model.model_fields[part].annotation
        inner = [a for a in getattr(annotation, "__args__", ()) if isinstance(a, type)]
        candidates = [annotation, *inner]
        model = next(c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel))
    return sorted(model.model_fields)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _yaml_position(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark else ""


def _yaml_problem(e: yaml.YAMLError) -> str:
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"{problem} ({context})" if context else problem


def _unknown_recipe_message(name: str) -> str:
    close = difflib.get_close_matches(name, list_recipes(), n=2, cutoff=0.6)
    if close:
        return f"unknown recipe '{name}'; did you mean: {', '.join(close)}? (forgesky recipes lists them)"
    return f"unknown recipe '{name}' (forgesky recipes lists them)"


# libyaml's parser where PyYAML has it (about ten times faster than the pure-Python one).
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _RecipeLoader(_SafeLoader):
    """SafeLoader that rejects duplicate keys, which plain YAML silently resolves to the last."""


def _construct_mapping(loader: _RecipeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable):
            continue  # yaml's own constructor reports unhashable keys
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}'", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
