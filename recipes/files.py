"""The settings of a recipe that may name a file or folder on this machine, and how to tell.

`model.hf_id` and `model.tokenizer` (a Hugging Face model folder), `dataset.path` and
`eval.path` (a data file, a saved dataset, a folder of data files) each take either a local path
or something remote: a Hub name (`Qwen/Qwen3-8B`, `openai/gsm8k`), a URL (`hf://`, `s3://`, ...)
or a shipped task (`builtin:tiny`). A value is local when it exists on this machine or looks like
a path (`/`, `~`, `./`, `../`, or a data file's suffix); everything else is remote. A model or
tokenizer URL names a folder in a bucket, which `forgesky launch` copies to the nodes
(launcher/files.py).

A relative path written in a recipe file is looked for next to that file first (and made
absolute when found there), then in the current directory; one given with `--set` is relative
to the current directory. Code the recipe names (`module:function` losses and rewards) is found
by recipes/references.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes.buckets import is_url
from recipes.errors import UserError

# Where each path-like setting lives in a recipe: (section, key).
PATH_FIELDS = (
    ("model", "hf_id"),
    ("model", "tokenizer"),
    ("dataset", "path"),
    ("eval", "path"),
)
# A data file's suffix -> the Hugging Face `datasets` builder that reads it.
DATA_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
DATA_FIELDS = ("dataset.path", "eval.path")
# The settings that may name a folder in a bucket (recipes/buckets.py), which `forgesky launch`
# copies to the nodes: a model (an SFT run's export, say) or a tokenizer.
BUCKET_FIELDS = ("model.hf_id", "model.tokenizer")


def is_remote(value: str) -> bool:
    """A shipped task or a URL (hf://, s3://, gs://, https://, ...): never a local path."""
    return value.startswith("builtin:") or "://" in value


def looks_local(value: str) -> bool:
    """Written as a path (absolute, `~`, `./`, `../`, or deeper than a Hub id's `owner/name`,
    as `runs/sft/model`) or named like a data file: local even when it does not exist (then a
    mistake to report, not a Hub name to look up)."""
    if is_remote(value):
        return False
    written = value.startswith(("/", "./", "../", "~")) or value.count("/") >= 2
    return written or Path(value).suffix in DATA_FILE_FORMATS


def local_path(value: str) -> Path | None:
    """The path on this machine that `value` names (relative to the current directory, `~`
    expanded, not resolved), or None for a remote one."""
    if is_remote(value):
        return None
    path = Path(value).expanduser()
    return path if looks_local(value) or path.exists() else None


def missing_path(where: str, path: Path) -> str:
    """The line for a local path that is not there (`where`: the setting and its value)."""
    return (
        f"{where}: no such file or folder ({os.path.abspath(path)}); a relative path in a "
        "recipe file is looked for next to the file, then in the current directory"
    )


def check_local_paths(settings: list[PathSetting]) -> None:
    """UserError (one line) for the first of `settings` (`read_paths`) naming a local path
    that is not there."""
    for setting in settings:
        path = local_path(setting.value)
        if path is not None and not path.exists():
            raise UserError(missing_path(f"{setting.field} {setting.value!r}", path))


def same_local(a: str, b: str) -> bool:
    """Two values naming one existing file or folder on this machine, however spelt."""
    first, second = local_path(a), local_path(b)
    if first is None or second is None or not (first.exists() and second.exists()):
        return False
    return first.resolve() == second.resolve()


def anchor(data: Any, folder: Path) -> Any:
    """Raw recipe data read from a file in `folder`, each relative path that exists in `folder`
    made absolute there; one that does not stays relative (to the current directory)."""
    if not isinstance(data, dict):
        return data
    for section, key in PATH_FIELDS:
        part = data.get(section)
        value = part.get(key) if isinstance(part, dict) else None
        if not isinstance(value, str) or is_remote(value) or value.startswith(("/", "~")):
            continue
        there = folder / value
        if value.strip() and there.exists():
            # normalised, not resolved: a link keeps its own name (a data file's suffix)
            part[key] = os.path.normpath(there)
    return data


@dataclass(frozen=True)
class PathSetting:
    """One path-like setting that a run reads: its dotted name and its value."""

    field: str
    value: str


def read_paths(recipe: Any) -> list[PathSetting]:
    """The path-like settings a run of `recipe` reads: the training data; the held-out data when
    evaluation is on; the model folder unless the run starts from random weights with a
    tokenizer of its own; the tokenizer when set."""
    model = recipe.model
    found = []
    if model.init == "hub" or model.tokenizer is None:
        found.append(PathSetting("model.hf_id", model.hf_id))
    if model.tokenizer is not None:
        found.append(PathSetting("model.tokenizer", model.tokenizer))
    found.append(PathSetting("dataset.path", recipe.dataset.path))
    if recipe.eval.enabled and recipe.eval.path is not None:
        found.append(PathSetting("eval.path", recipe.eval.path))
    return found


def bucket_reads(recipe: Any) -> list[PathSetting]:
    """The settings a run of `recipe` reads that name a folder in a bucket (a model, a
    tokenizer): the nodes get a copy, a run on this machine cannot read them."""
    return [s for s in read_paths(recipe) if s.field in BUCKET_FIELDS and is_url(s.value)]
