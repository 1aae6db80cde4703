"""SFT rows without a tokenizer: a row as chat messages, the checks every row must pass (the
fields the recipe names, an assistant turn that says something), and a local data file read
with the standard library, so that `forgesky validate`, `plan`, `launch` and `local` refuse bad
local data in one line before anything starts (no torch, no `datasets`, no tokenizer).

What needs the tokenizer (the chat template, a row's length in tokens against
`dataset.max_tokens`) is checked as the run starts, before its trainer does
(runtime/sft/run.py). Hub data and saved datasets are checked as the run loads them.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from recipes.errors import UserError
from recipes.files import DATA_FIELDS, check_local_paths, local_path, read_paths

# The data files read here: JSON Lines, a JSON array of rows, CSV (what `datasets` reads them
# as too: runtime/tasks/data.py). Parquet and saved datasets are left to the run.
_PLAIN = (".jsonl", ".json", ".csv")
# The rows of a file looked at before anything starts (a few tenths of a second for 10,000
# chats of 1.6 kB): `plan` stays fast on a large file; the run checks every row as it loads them.
ROWS_LOOKED_AT = 10_000


def conversation(row: Mapping[str, Any], dataset: Any) -> list[dict[str, str]]:
    """A row as chat messages (the system prompt first where it has none)."""
    if dataset.format == "messages":
        messages = [
            {"role": m["role"], "content": m["content"]} for m in row[dataset.messages_field]
        ]
    else:
        messages = [
            {"role": "user", "content": row[dataset.prompt_field]},
            {"role": "assistant", "content": row[dataset.completion_field]},
        ]
    if dataset.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": dataset.system_prompt})
    return messages


def check_rows(rows: Sequence[Mapping[str, Any]], dataset: Any, name: str) -> None:
    """UserError for data the run cannot train on: no rows, a field the recipe names that the
    data lacks (with the fields it has), a row that is not chat turns, a row without an
    assistant turn that says something. `rows`: a list of dicts or a `datasets.Dataset`."""
    if len(rows) == 0:
        raise UserError(f"dataset {name!r} has no rows")
    names = getattr(rows, "column_names", None)
    if names is None:  # plain rows: the fields of any row, as `datasets` reads a file
        names = list(dict.fromkeys(key for row in rows for key in row))
    check_fields(list(names), dataset, name)
    for i in range(len(rows)):
        check_row(rows[i], i, dataset, name)


def check_fields(columns: list[str], dataset: Any, name: str) -> None:
    """UserError where a field the recipe names is not among the data's `columns`."""
    setting = "messages_field" if dataset.format == "messages" else "prompt_field"
    for key, column in zip((setting, "completion_field"), dataset.fields, strict=False):
        if column not in columns:
            raise UserError(
                f"dataset {name!r}: dataset.{key} {column!r} is not a field of the data "
                f"(format {dataset.format}); its fields: {', '.join(columns) or 'none'}"
            )


def check_row(row: Mapping[str, Any], i: int, dataset: Any, name: str) -> None:
    """UserError where row `i` is not chat turns, or none of its assistant turns says
    anything."""
    try:
        messages = conversation(row, dataset)
    except (KeyError, TypeError, AttributeError):
        if dataset.format == "messages":
            what = f"its {dataset.messages_field!r} is not a list of {{role, content}} turns"
        else:
            what = f"it lacks {dataset.prompt_field!r} or {dataset.completion_field!r}"
        raise UserError(f"dataset {name!r} row {i}: {what}; fix or remove the row") from None
    said = [m for m in messages if m["role"] == "assistant" and str(m["content"] or "").strip()]
    if not said:
        raise UserError(
            f"dataset {name!r} row {i}: no assistant turn with content (an empty assistant "
            "turn set: nothing to train on); fix or remove the row"
        )


def read_plain(path: Path, name: str) -> Iterator[dict[str, Any]]:
    """The rows of a local .jsonl, .json or .csv file, read as they come; UserError (one line)
    at the first that is not a JSON object."""
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            yield from csv.DictReader(f)
        return
    with path.open(encoding="utf-8") as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        f.seek(0)
        if path.suffix == ".json" and first == "[":  # one JSON array of rows
            rows = _parsed(f.read(), name, None)
            if not isinstance(rows, list):
                raise UserError(f"dataset {name!r}: not a JSON array of rows")
            for i, row in enumerate(rows):
                yield _object(row, name, f"row {i}")
            return
        for number, line in enumerate(f, 1):
            if line.strip():
                yield _object(_parsed(line, name, number), name, f"line {number}")


def _parsed(text: str, name: str, line: int | None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        # a line of JSON Lines is one line of the file: its column alone, not json's "line 1"
        at = f"line {e.lineno if line is None else line} column {e.colno}"
        raise UserError(f"dataset {name!r} {at}: not JSON ({e.msg})") from None


def _object(row: Any, name: str, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise UserError(f"dataset {name!r} {where}: a row is a JSON object of fields")
    return row


def check_local_data(recipe: Any) -> None:
    """UserError (one line) for the first fault: a local path the run reads (its data, model
    folder or tokenizer: recipes.files.read_paths) that is not there; an SFT recipe's training
    and held-out data, where each is a local .jsonl, .json or .csv file, checked as the run
    would check it (check_rows) up to its first ROWS_LOOKED_AT rows, read with the standard
    library. Other data, and the rows after those, are the run's to check as it loads them."""
    settings = read_paths(recipe)
    check_local_paths(settings)  # any recipe's
    if recipe.kind != "sft":
        return
    check_local_template(recipe)
    data: dict[str, str] = {}  # each file once, named by its first setting
    for s in settings:
        if s.field in DATA_FIELDS:
            data.setdefault(s.value, s.field)
    for source, setting in data.items():
        path = local_path(source)
        if path is None or path.suffix not in _PLAIN or not path.is_file():
            continue  # Hub data, a saved dataset, Parquet: the run checks them as it loads
        try:
            rows = itertools.islice(read_plain(path, source), ROWS_LOOKED_AT)
            _check_stream(rows, recipe.dataset, source)
        except UserError as fault:
            # the held-out file's faults name its setting: the messages say "dataset"
            line = fault.args[0] if setting == "dataset.path" else f"{setting}: {fault}"
            raise UserError(line) from None


def check_local_template(recipe: Any) -> None:
    """UserError where the tokenizer SFT applies is a local folder whose files hold no chat
    template (`chat_template.jinja`, `chat_template.json`, or `chat_template` in
    `tokenizer_config.json`, where transformers keeps it). A Hub tokenizer's is checked as the
    run loads it (runtime.sft.data.ChatEncoder, the same line)."""
    m = recipe.model
    setting = "model.tokenizer" if m.tokenizer is not None else "model.hf_id"
    folder = local_path(m.tokenizer or m.hf_id)
    if folder is None or not folder.is_dir():
        return
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return  # not a tokenizer folder this can read: the run loads it and says
    if isinstance(config, dict) and not config.get("chat_template"):
        raise UserError(no_template(setting))


def no_template(setting: str) -> str:
    """The line for a tokenizer without a chat template (`setting`: where it comes from)."""
    return (
        f"{setting}: the tokenizer has no chat template, which SFT applies to every row; "
        "use the family's tokenizer (model.tokenizer) or one with a chat template"
    )


def _check_stream(rows: Iterator[Mapping[str, Any]], dataset: Any, name: str) -> None:
    """check_rows over rows read one at a time, none kept: the fields are looked for in the
    first row (where it lacks one, in every row, to name the fields the data has)."""
    count = 0
    for i, row in enumerate(rows):
        if i == 0 and any(field not in row for field in dataset.fields):
            columns = dict.fromkeys(row)
            for later in rows:
                columns.update(dict.fromkeys(later))
            check_fields(list(columns), dataset, name)
        check_row(row, i, dataset, name)
        count += 1
    if not count:
        raise UserError(f"dataset {name!r} has no rows")
