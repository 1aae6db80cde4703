"""Prompt sources: the recipe's dataset as an endless, seeded, resumable stream of prompts.

`build_prompt_source(recipe.dataset, seed=...)` picks the source: "builtin:<name>" for the tasks
the project ships (runtime/tasks/registry.py), anything else is loaded with
Hugging Face `datasets`: a Hub dataset, a local .jsonl/.json/.csv/.parquet file, a directory
written by `save_to_disk`, or a directory of data files.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes.errors import UserError
from recipes.files import DATA_FILE_FORMATS, looks_local


@dataclass(frozen=True)
class Prompt:
    """One prompt: `id` is its row in the source (stable across epochs and shuffles)."""

    id: int
    text: str
    answer: str
    system: str | None = None

    def messages(self) -> list[dict[str, str]]:
        """Chat messages for a tokenizer's chat template."""
        user = [{"role": "user", "content": self.text}]
        return [{"role": "system", "content": self.system}, *user] if self.system else user


class PromptSource:
    """Rows (any sequence of mappings: a list of dicts, a `datasets.Dataset`) as prompts.

    Iterating never ends: each epoch visits every row once, in an order drawn from
    `(seed, epoch)` when `shuffle`, so a run and its resumption see the same prompts in the same
    order. The position is `state_dict()`; `load_state_dict()` puts it back.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        prompt_field: str = "question",
        answer_field: str = "answer",
        prompt_template: str = "{question}",
        system_prompt: str | None = None,
        seed: int = 0,
        shuffle: bool = True,
        name: str = "dataset",
    ):
        self.rows = rows
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.name = name
        self.epoch = 0
        self.index = 0
        self._order: tuple[int, list[int]] | None = None
        if len(rows) == 0:
            raise UserError(f"dataset {name!r} has no rows")
        columns = _columns(rows)
        for field, column in (("prompt_field", prompt_field), ("answer_field", answer_field)):
            if column not in columns:
                raise UserError(
                    f"dataset {name!r}: dataset.{field} {column!r} is not a column; "
                    f"columns: {', '.join(columns)}"
                )
        self.prompt(0)  # a broken template fails now, not mid-run

    @classmethod
    def for_dataset(
        cls, rows: Sequence[Mapping[str, Any]], dataset: Any, *, seed: int = 0, shuffle: bool = True
    ) -> PromptSource:
        """A source over `rows` with the recipe `dataset` section's fields, template and system
        prompt; what a builtin task's factory usually returns."""
        name = getattr(dataset, "path", "dataset")
        return cls(rows, seed=seed, shuffle=shuffle, name=name, **_formatting(dataset))

    def __len__(self) -> int:
        return len(self.rows)

    def prompt(self, row: int) -> Prompt:
        """Row `row` as a Prompt."""
        record = self.rows[row]
        try:
            text = self.prompt_template.format(question=str(record[self.prompt_field]))
        except (KeyError, IndexError) as e:
            raise UserError(
                f"dataset.prompt_template: unknown placeholder {{{e.args[0]}}}; "
                "the only one is {question}"
            ) from None
        except ValueError as e:
            raise UserError(f"dataset.prompt_template: not a format string: {e}") from None
        answer = record[self.answer_field]
        return Prompt(row, text, "" if answer is None else str(answer), self.system_prompt)

    def order(self, epoch: int) -> list[int]:
        """The rows of `epoch` in visiting order."""
        if self._order is None or self._order[0] != epoch:
            rows = list(range(len(self.rows)))
            if self.shuffle:
                # A string seed is hashed with SHA-512: the order does not depend on PYTHONHASHSEED.
                random.Random(f"forgesky:{self.seed}:{epoch}").shuffle(rows)
            self._order = (epoch, rows)
        return self._order[1]

    def __iter__(self) -> PromptSource:
        return self

    def __next__(self) -> Prompt:
        prompt = self.prompt(self.order(self.epoch)[self.index])
        self.index += 1
        if self.index == len(self.rows):
            self.epoch, self.index = self.epoch + 1, 0
        return prompt

    def take(self, n: int) -> list[Prompt]:
        """The next `n` prompts."""
        return [next(self) for _ in range(n)]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "num_prompts": len(self.rows),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at a saved position (the saved seed wins, so the order is the saved run's)."""
        saved = state.get("num_prompts", len(self.rows))
        if saved != len(self.rows):
            raise UserError(
                f"dataset {self.name!r} has {len(self.rows)} prompts but the checkpoint was taken "
                f"with {saved}; resume with the same dataset or start a new run directory"
            )
        self.epoch, self.index, self.seed = (
            int(state["epoch"]),
            int(state["index"]),
            int(state["seed"]),
        )
        self._order = None


class HFPromptSource(PromptSource):
    """Prompts from a Hugging Face dataset: a Hub path, a local data file, or a saved dataset."""

    def __init__(
        self,
        path: str,
        config: str | None = None,
        split: str = "train",
        *,
        cache_dir: str | None = None,
        **kwargs: Any,
    ):
        dataset = load_hf_dataset(path, config, split, cache_dir=cache_dir)
        super().__init__(dataset, name=path, **kwargs)


def load_hf_dataset(
    path: str, config: str | None = None, split: str = "train", *, cache_dir: str | None = None
) -> Any:
    """One split of a dataset as a `datasets.Dataset`; UserError naming the path when it cannot."""
    import datasets  # heavy; only sources that read HF data pay for it

    local = Path(path).expanduser()
    if local.is_file():
        builder = DATA_FILE_FORMATS.get(local.suffix)
        if builder is None:
            raise UserError(
                f"dataset {path!r}: unsupported file type; use .jsonl, .json, .csv or .parquet"
            )
        # A local file has no splits of its own: it is the split the recipe asks for.
        files = {split: str(local)}
        return datasets.load_dataset(builder, data_files=files, split=split, cache_dir=cache_dir)
    if (local / "state.json").is_file() or (local / "dataset_dict.json").is_file():
        saved = datasets.load_from_disk(str(local))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise UserError(f"dataset {path!r}: no split {split!r}; splits: {', '.join(saved)}")
            saved = saved[split]
        return saved
    if looks_local(path) and not local.exists():
        raise UserError(f"dataset {path!r}: no such file or directory")
    from runtime.hub import UNREACHABLE, quiet_retries

    try:
        with quiet_retries() as failed_requests:
            return datasets.load_dataset(path, config, split=split, cache_dir=cache_dir)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise UserError(f"dataset {path!r}: not found ({_first_line(e)})") from None
    except (ConnectionError, OSError, RuntimeError) as e:
        # no network (or the Hub refused): datasets and huggingface_hub raise all of these;
        # the first failed request says why better than the error the load ends with
        if failed_requests:
            why = f"{UNREACHABLE}: {failed_requests[0]}"
        else:
            why = f"could not be loaded ({_first_line(e)})"
        raise UserError(
            f"dataset {path!r}: {why}; check the network, or use a local file "
            "(dataset.path=FILE.jsonl)"
        ) from None
    except ValueError as e:
        # Bad split or config names: datasets' message already lists the valid ones.
        if str(e).startswith(("Unknown split", "BuilderConfig")):
            raise UserError(f"dataset {path!r}: {_first_line(e)}") from None
        raise


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# ---------------------------------------------------------------- the recipe's source


def build_prompt_source(
    dataset: Any,
    *,
    seed: int = 0,
    split: str | None = None,
    path: str | None = None,
    shuffle: bool = True,
) -> PromptSource:
    """The prompt source for a recipe's `dataset` section: a shipped task's prompts
    (`builtin:<name>`) or a dataset loaded with Hugging Face `datasets`; `split` and `path`
    (default the section's) name other data in the same columns, the held-out data of an
    evaluation (then `shuffle` False: the data's own order)."""
    from runtime.tasks.registry import shipped_task

    path = path or dataset.path
    if path.startswith("builtin:"):
        task = shipped_task(path.removeprefix("builtin:"), field="dataset.path")
        rows = task.rows(split or "train")
        return PromptSource.for_dataset(rows, dataset, seed=seed, shuffle=shuffle)
    return HFPromptSource(
        path,
        dataset.config,
        split or dataset.split,
        seed=seed,
        shuffle=shuffle,
        **_formatting(dataset),
    )


def _formatting(dataset: Any) -> dict[str, Any]:
    return {
        "prompt_field": dataset.prompt_field,
        "answer_field": dataset.answer_field,
        "prompt_template": dataset.prompt_template,
        "system_prompt": dataset.system_prompt,
    }


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    names = getattr(rows, "column_names", None)
    return list(names) if names is not None else list(rows[0].keys())
