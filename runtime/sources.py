"""What a SOURCE of `forgesky eval` and `forgesky export` names, checked on disk before any
weight is read: a run directory, one of its checkpoints, a Hugging Face model folder or a LoRA
adapter folder (`Source`, `resolve_source`); the recipe it is read with (`resolve_recipe`);
and that recipe for the model with any adapter merged in (`full_model`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes import UserError


@dataclass(frozen=True)
class Source:
    """What SOURCE names: `kind` "checkpoint" (with the run's recorded recipe, if found), "hf"
    (a model folder) or "adapter" (a LoRA adapter folder)."""

    kind: str
    path: Path
    step: int | None = None
    recorded: Path | None = None  # the run's config.json
    exported: Path | None = None  # a model folder's forgesky.json


# What a model folder that forgesky wrote records of where it came from (runtime.models.export).
EXPORT_RECORD = "forgesky.json"
# The files of a LoRA adapter folder (runtime.models.peft_format's, named here too: a SOURCE is
# told apart before torch loads).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def resolve_source(text: str, command: str = "eval") -> Source:
    """SOURCE checked on disk without loading anything; UserError says what is wrong."""
    from runtime.control import checkpoint

    if not text.strip():
        raise UserError(f"{command}: SOURCE is blank; give a run directory or a model folder")
    path = Path(text).expanduser()
    if not path.exists():
        raise UserError(f"{command}: {text}: no such file or directory")
    if not path.is_dir():
        raise UserError(f"{command}: {text} is a file; give a run directory or a model folder")
    if any((path / name).exists() for name in ("trainer", "trainer.pt", checkpoint.MARKER)):
        if not (path / checkpoint.MARKER).exists():
            raise UserError(
                f"{command}: checkpoint {text} was never committed (no {checkpoint.MARKER})"
            )
        step = _step_of(path)
        # its files against its marker: one cut short is named before anything is read
        found = next((c for c in checkpoint.committed(path.parent) if c.path == path), None)
        if found is not None:
            try:
                checkpoint.verify(found, f"{command} needs a committed checkpoint that is whole")
            except UserError as e:
                raise UserError(f"{command}: {e}") from None
        return Source("checkpoint", path, step, _recorded(path.parent.parent))
    if (path / "checkpoints").is_dir():
        found = checkpoint.latest(
            path / "checkpoints", advice=f"{command} needs a committed checkpoint that is whole"
        )
        if found is None:
            raise UserError(
                f"{command}: run {text} has no committed checkpoint in {path}/checkpoints"
            )
        return Source("checkpoint", found.path, found.step, _recorded(path))
    record = path / EXPORT_RECORD
    exported = record if record.is_file() else None
    if all((path / name).is_file() for name in ADAPTER_FILES):
        return Source("adapter", path, exported=exported)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return Source("hf", path, exported=exported)
    raise UserError(
        f"{command}: {text} is neither a run directory (checkpoints/), a checkpoint (COMMITTED, "
        "trainer/), a model folder (config.json, *.safetensors) nor an adapter folder "
        "(adapter_config.json, adapter_model.safetensors)"
    )


def _step_of(path: Path) -> int | None:
    name = path.name
    return int(name.removeprefix("step_")) if name.removeprefix("step_").isdigit() else None


def _recorded(run_dir: Path) -> Path | None:
    config = run_dir / "config.json"
    return config if config.is_file() else None


def exported_step(source: Source) -> int | None:
    """The step of the checkpoint a model folder was written from, where its forgesky.json
    says (the step of a checkpoint source)."""
    if source.exported is None:
        return source.step
    try:
        step = json.loads(source.exported.read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def resolve_recipe(
    source: Source, recipe: str | None, overrides: list[str], command: str = "eval"
) -> Any:
    """The recipe to evaluate with: `--recipe`, else the one the run recorded."""
    from recipes import apply_overrides, load_recipe, validate_recipe

    if recipe is not None:
        base = load_recipe(recipe)
        _check_recorded_model(source, base, command)  # before any weight is read
    elif source.recorded is not None:
        try:
            data = json.loads(source.recorded.read_text())
        except (OSError, ValueError) as e:
            raise UserError(
                f"{command}: cannot read {source.recorded} ({e}); pass --recipe"
            ) from None
        data.pop("plan", None)
        base = validate_recipe(data, str(source.recorded))
    elif source.exported is not None:
        base = _exported_recipe(source.exported, command, adapter=source.kind == "adapter")
    elif source.kind in ("hf", "adapter"):
        raise UserError(
            f"{command}: {source.path} has no {EXPORT_RECORD} naming its recipe (forgesky did not "
            "write it); pass --recipe, the recipe whose data, rewards and sampling apply"
        )
    else:
        raise UserError(
            f"{command}: {source.path} has no recorded recipe (config.json); pass --recipe"
        )
    # the eval section applies whether or not the run evaluated: enabling it checks it
    resolved = apply_overrides(base, ["eval.enabled=true", *overrides])
    if recipe is not None:
        _check_recorded_lora(source, resolved, command)
    return resolved


def _exported_recipe(path: Path, command: str, adapter: bool = False) -> Any:
    """The recipe a model folder's forgesky.json records: the recipe itself where the export
    wrote it, else (an older export) the catalog recipe it names. For an `adapter` folder, less
    its `model.lora` (`full_model`): the folder's adapter_config.json says what the adapter is,
    the recipe what it is evaluated on and merged into."""
    from recipes import list_recipes, load_recipe, validate_recipe

    where = str(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{command}: cannot read {where} ({e}); pass --recipe") from None
    if not isinstance(record, dict):
        raise UserError(f"{command}: {where} is not what an export records; pass --recipe")
    if isinstance(record.get("recipe_config"), dict):
        recipe = validate_recipe(dict(record["recipe_config"]), where)
        return full_model(recipe) if adapter else recipe
    name = record.get("recipe")
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{command}: {where} names no recipe; pass --recipe")
    if name not in list_recipes():
        raise UserError(
            f"{command}: {where} names recipe {name!r}, which is not in the catalog; pass "
            "--recipe with the recipe file the run used"
        )
    return full_model(load_recipe(name)) if adapter else load_recipe(name)


def _recorded_model(source: Source) -> Any:
    """The `model` section the run recorded, or None where there is none or it cannot be read
    (then loading the weights says what does not fit)."""
    if source.recorded is None:
        return None
    try:
        return json.loads(source.recorded.read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return None


def _check_recorded_model(source: Source, recipe: Any, command: str) -> None:
    """--recipe for a run's checkpoint: its model must have the shapes of the one the run
    recorded (what would not load is said before the weights are read)."""
    from recipes.architectures import same_shapes

    old = _recorded_model(source)
    new = recipe.model
    if isinstance(old, dict) and not same_shapes(old, new.family, new.size):
        raise UserError(
            f"{command}: the run trained {old.get('hf_id')} ({old.get('family')} "
            f"{old.get('size')}) and --recipe {recipe.name} is {new.hf_id} ({new.family} "
            f"{new.size}): its weights do not fit; give a recipe of the run's model"
        )


def _check_recorded_lora(source: Source, recipe: Any, command: str) -> None:
    """--recipe (with its --set) for a run's checkpoint: LoRA where the run was LoRA, full
    where it trained every parameter (said before torch loads, not as an unreadable
    checkpoint)."""
    old = _recorded_model(source) if source.kind == "checkpoint" else None
    if not isinstance(old, dict) or "lora" not in old:
        return
    if (old["lora"] is None) != (recipe.model.lora is None):
        trained = "every parameter" if old["lora"] is None else "a LoRA adapter"
        wants = "a LoRA recipe" if recipe.model.lora is not None else "a full-parameter recipe"
        raise UserError(
            f"{command}: the run trained {trained} and --recipe {recipe.name} is {wants}: its "
            "checkpoint does not hold what that recipe loads; leave --recipe out (the run's "
            "own recipe is used) or give one with the run's model.lora"
        )


def full_model(recipe: Any) -> Any:
    """The recipe for the model with any LoRA adapter merged in: its `model.lora` dropped, and
    a reference scored in the trainer (the base with the adapter off, which a full model has
    not) made one of its own, as in the full-parameter recipes: a recipe that validates, for
    eval's generator and the merged folder's record."""
    from recipes.service_sections import ReferenceLayout

    if recipe.model.lora is None:
        return recipe
    layout = recipe.layout
    if recipe.kind == "grpo" and layout.reference.device == "trainer":
        device = ReferenceLayout.model_fields["device"].default
        reference = layout.reference.model_copy(update={"device": device})
        layout = layout.model_copy(update={"reference": reference})
    model = recipe.model.model_copy(update={"lora": None})
    return recipe.model_copy(update={"model": model, "layout": layout})
