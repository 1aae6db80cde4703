"""A trained policy as a Hugging Face model folder: what transformers and vLLM load.

The folder holds the weights as safetensors (sharded the usual way, with an index past one
shard), `config.json` (the architecture, the dtype, the token ids), `generation_config.json`
(the run's sampling) and the tokenizer's files. It is written into `<folder>.partial` and renamed
when complete, so a folder that exists is whole.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from recipes.memory import EXPORT_FILE_BYTES
from runtime.models.hf import hf_config
from runtime.models.spec import ModelSpec

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# Safetensors files of at most this many bytes, as transformers and the Hub shard them (the
# host-memory plan counts one file's weights for the export).
SHARD_BYTES = EXPORT_FILE_BYTES


def write_hf_model(
    hf_state: dict[str, torch.Tensor], spec: ModelSpec, folder: str | Path, **options: Any
) -> Path:
    """Write HF-named weights (`hf_state`, any dtype, any device) and everything a loader needs
    into `folder` (replaced if it exists); returns it. `options`: `write_hf_model_groups`'."""
    layout = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in hf_state.items()}
    return write_hf_model_groups([hf_state], layout, spec, folder, **options)


def write_hf_model_groups(
    groups: Iterable[dict[str, torch.Tensor]],
    layout: dict[str, torch.Tensor],
    spec: ModelSpec,
    folder: str | Path,
    *,
    tokenizer: Any,
    dtype: str = "bfloat16",
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_shard_bytes: int = SHARD_BYTES,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """`write_hf_model` from weights handed over a group at a time (a gathered block, a block
    read from a checkpoint): `layout` names every tensor with its shape (meta tensors do), in
    the order the groups bring them, which fixes the files before any weight arrives; each file
    is written as soon as its last tensor has come. In that order nothing holds more than one
    file's weights and the group in hand, whatever the model's size."""
    from transformers import GenerationConfig

    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    target = DTYPES[dtype]
    names = [n for n in layout if not (spec.tie_embeddings and n == "lm_head.weight")]
    shards = _shards({n: layout[n].numel() * target.itemsize for n in names}, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    where = {name: i for i, shard in enumerate(shards) for name in shard}
    try:
        pending: list[dict[str, torch.Tensor]] = [{} for _ in shards]
        for group in groups:
            for name, tensor in group.items():
                if name not in where:
                    if spec.tie_embeddings and name == "lm_head.weight":
                        continue  # tied: the embedding is the output projection
                    raise ValueError(f"{name!r} is not in the model's layout")
                i = where[name]
                pending[i][name] = _own(tensor.detach().to("cpu", target))
                if len(pending[i]) == len(shards[i]):
                    _save(pending[i], partial / files[i])
                    pending[i] = {}
        absent = [
            n for n, i in where.items() if not (partial / files[i]).exists() and n not in pending[i]
        ]
        if absent:
            raise ValueError(f"{len(absent)} tensors of the layout never came, e.g. {absent[0]!r}")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # no half-written folder left behind
        raise
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(layout[n].numel() * target.itemsize for n in names)},
            "weight_map": {n: files[where[n]] for n in names},
        }
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    ids = _token_ids(tokenizer)
    config = hf_config(spec, **ids)
    config.dtype = target
    config.save_pretrained(partial)
    GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p, **ids).save_pretrained(
        partial
    )
    tokenizer.save_pretrained(partial)
    if provenance:
        (partial / "forgesky.json").write_text(json.dumps(provenance, indent=2) + "\n")
    for file in partial.iterdir():
        file.chmod(0o644)  # readable like any model folder (the weights come out owner-only)
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)
    return folder


def _shards(sizes: dict[str, int], most: int) -> list[list[str]]:
    """Names in files of at most `most` bytes, in order (a larger tensor has a file alone)."""
    shards: list[list[str]] = [[]]
    held = 0
    for name, size in sizes.items():
        if shards[-1] and held + size > most:
            shards.append([])
            held = 0
        shards[-1].append(name)
        held += size
    return shards


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in storage of its own: safetensors refuses views into a larger buffer (what gathered
    or flat-published weights are)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return {k: v for k, v in ids.items() if v is not None}
