"""Loading pretrained weights: Hugging Face Hub (or a local HF folder) → safetensors → TorchTitan."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from recipes.errors import UserError
from runtime.models.hf import from_hf
from runtime.models.spec import ModelSpec

# config.json keys that must agree with the spec for the weights to fit the model.
_CONFIG_CHECKS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_dim",
}


def snapshot(hf_id: str, token: str | None = None, revision: str | None = None) -> Path:
    """A local folder with the model's config and safetensors: `hf_id` itself if it is a folder,
    otherwise a Hugging Face Hub download (cached)."""
    local = Path(hf_id).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        path = snapshot_download(
            hf_id,
            revision=revision,
            token=token,
            allow_patterns=["*.safetensors", "*.json"],
        )
    except GatedRepoError as e:
        raise UserError(
            f"model {hf_id} is gated: accept its licence on huggingface.co and set HF_TOKEN"
        ) from e
    except RepositoryNotFoundError as e:
        raise UserError(
            f"model {hf_id} not found on the Hugging Face Hub (or it is private: set HF_TOKEN)"
        ) from e
    return Path(path)


def load_hf_state_dict(
    hf_id: str, token: str | None = None, revision: str | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under its HF name (the generator's format)."""
    return _read_safetensors(snapshot(hf_id, token, revision), hf_id)


def _read_safetensors(folder: Path, hf_id: str) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"model {hf_id}: no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def check_config(folder: Path, spec: ModelSpec, hf_id: str) -> None:
    """Fail with one line if the checkpoint's config.json disagrees with the architecture."""
    config_path = folder / "config.json"
    if not config_path.exists():
        return
    config = json.loads(config_path.read_text())
    for hf_key, field_name in _CONFIG_CHECKS.items():
        if hf_key in config and config[hf_key] != getattr(spec, field_name):
            raise UserError(
                f"model {hf_id}: config.json has {hf_key}={config[hf_key]} but the recipe's "
                f"architecture has {field_name}={getattr(spec, field_name)}; fix model.size"
            )


def load_pretrained(
    hf_id: str, spec: ModelSpec, token: str | None = None, revision: str | None = None
) -> dict[str, torch.Tensor]:
    """TorchTitan-named weights of `hf_id` for a model built from `spec`."""
    folder = snapshot(hf_id, token, revision)
    check_config(folder, spec, hf_id)
    return from_hf(_read_safetensors(folder, hf_id), spec)
