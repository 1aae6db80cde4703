"""A trained policy as a Hugging Face model folder: what transformers and vLLM load.

The folder holds the weights as safetensors (sharded the usual way, with an index past one
shard), `config.json` (the architecture, the dtype, the token ids), `generation_config.json`
(the run's sampling) and the tokenizer's files. It is written into `<folder>.partial` and renamed
when complete, so a folder that exists is whole.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from runtime.models.hf import hf_config
from runtime.models.spec import ModelSpec

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def write_hf_model(
    hf_state: dict[str, torch.Tensor],
    spec: ModelSpec,
    folder: str | Path,
    *,
    tokenizer: Any,
    dtype: str = "bfloat16",
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_shard_size: str | int = "5GB",
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Write HF-named weights (`hf_state`, any dtype, any device) and everything a loader needs
    into `folder` (replaced if it exists); returns it."""
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    target = DTYPES[dtype]
    weights = {k: _own(v.detach().to("cpu", target)) for k, v in hf_state.items()}
    if spec.tie_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the embedding is the output projection
    # its INFO line ("Model weights successfully saved to ...partial!") names a folder that is
    # renamed a moment later; the run prints where the model is. (Its logger is named by the
    # module's file path.)
    hub_log = logging.getLogger(sys.modules[save_torch_state_dict.__module__].__file__)
    level = hub_log.level
    hub_log.setLevel(max(level, logging.WARNING))
    try:
        save_torch_state_dict(weights, partial, max_shard_size=max_shard_size)
    finally:
        hub_log.setLevel(level)
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
