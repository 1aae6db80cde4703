"""`forgesky export RUN_DIR`: a run's policy as a Hugging Face model folder, and on request on the
Hub. A LoRA run's policy is its adapter, written as a PEFT folder (adapter_config.json,
adapter_model.safetensors); `--merge` writes it merged into its base as a full model folder
instead, read and written a block at a time.

A run writes RUN_DIR/model when it finishes; this writes the same from any committed checkpoint
(`--step`, default the newest) of a run directory, or from one checkpoint directory, with the
recipe the run recorded (`--recipe` for a checkpoint without one), into a new or empty folder
(`--out`: one that holds anything is refused, never replaced). `--push-to-hub REPO` then
uploads the folder to a (private, if new) Hub repository with the token in HF_TOKEN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recipes import UserError
from recipes.memory import model_file_bytes


def pick_checkpoint(source_text: str, step: int | None) -> Any:
    """The checkpoint SOURCE and `--step` name (runtime.sources.Source)."""
    from runtime.sources import resolve_source

    path = Path(source_text).expanduser()
    if step is not None and (path / "checkpoints").is_dir():
        # the named step alone: a newer damaged one is none of this export's business
        config = path / "config.json"
        return _committed_step(path, step, config if config.is_file() else None)
    source = resolve_source(source_text, command="export")
    if source.kind in ("hf", "adapter"):
        what = "an adapter folder" if source.kind == "adapter" else "a model folder"
        raise UserError(f"export: {source_text} is {what} already; give a run directory")
    if step is None or step == source.step:
        return source
    return _committed_step(source.path.parent.parent, step, source.recorded)


def _committed_step(run_dir: Path, step: int, recorded: Path | None) -> Any:
    """Checkpoint `step` of `run_dir`, committed and whole, or a UserError saying why not."""
    from runtime.control import checkpoint
    from runtime.sources import Source

    found = {c.step: c for c in checkpoint.committed(run_dir / "checkpoints")}
    if step not in found:
        have = ", ".join(map(str, sorted(found))) or "none"
        raise UserError(
            f"export: no committed checkpoint of step {step} in {run_dir} (have {have})"
        )
    try:
        checkpoint.verify(found[step], advice="export needs a committed checkpoint that is whole")
    except UserError as e:
        raise UserError(f"export: {e}") from None
    return Source("checkpoint", found[step].path, step, recorded)


def out_folder(out: str) -> Path:
    """`--out` as the folder to write: a new one, or an empty one; never a file, a folder that
    holds anything (it would be replaced), or the working directory."""
    if not out.strip():
        raise UserError("export: --out is blank; name the folder to write")
    folder = Path(out).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"export: --out {out} is a file; name a folder to write")
    if folder.is_dir() and any(folder.iterdir()):
        raise UserError(
            f"export: --out {out} is not empty; name a new folder, or remove what is in it"
        )
    if folder == Path.cwd().resolve():
        raise UserError(f"export: --out {out} is the working directory; name a folder inside it")
    return folder


def run(
    source_text: str,
    out: str,
    *,
    step: int | None = None,
    recipe_name: str | None = None,
    push_to_hub: str | None = None,
    merge: bool = False,
) -> int:
    """Export; UserError for what the user can fix."""
    from runtime.hub import hf_token

    # what the arguments and the disk say first: bad input is refused before torch loads
    folder = out_folder(out)
    if push_to_hub is not None and not push_to_hub.strip():
        raise UserError("export: --push-to-hub is blank; name the Hub repository (owner/name)")
    token = hf_token()
    if push_to_hub and token is None:
        raise UserError("export: --push-to-hub needs a Hugging Face token in HF_TOKEN")
    if push_to_hub:
        check_repo_id(push_to_hub)
    source = pick_checkpoint(source_text, step)
    from runtime.sources import full_model, resolve_recipe

    recipe = resolve_recipe(source, recipe_name, [], command="export")
    if merge and recipe.model.lora is None:
        raise UserError(
            f"export: --merge: {source_text} trained every parameter; its export is a full "
            "model already (drop --merge)"
        )
    size = model_file_bytes(full_model(recipe) if merge else recipe)
    check_room(folder, size, what=f"export: --out {out}")
    print(f"exporting step {source.step} of {source.path.parent.parent} to {out}", flush=True)
    provenance = {"recipe": recipe.name, "step": source.step, "checkpoint": str(source.path)}
    folder = write(source, recipe, folder, provenance, merge=merge)  # torch: after every check
    files = sorted(p.name for p in folder.iterdir())
    print(f"wrote {folder}: {', '.join(files)}", flush=True)
    if push_to_hub:
        url = push(folder, push_to_hub, token)
        print(f"pushed to {url}", flush=True)
    return 0


def write_run_model(run_dir: Path, recipe: Any, step: int) -> Path:
    """RUN_DIR/model from the run's committed checkpoint of `step`, as the run writes it at its
    end (there from the trainer's memory; here read from disk in this process)."""
    source = _committed_step(run_dir, step, None)
    provenance = {"recipe": recipe.name, "step": step, "run_dir": str(run_dir)}
    return write(source, recipe, run_dir / "model", provenance)


def write(
    source: Any, recipe: Any, folder: Path, provenance: dict[str, Any], *, merge: bool = False
) -> Path:
    """The policy of checkpoint `source` into `folder`: a full model folder, or for a LoRA run
    its adapter folder (`merge`: the adapter merged into its base, a full model folder)."""
    from runtime.backends import build
    from runtime.eval_weights import (
        adapter_tensors,
        base_layout,
        hf_weight_groups,
        is_lora,
        merged_groups,
    )
    from runtime.models.export import DTYPES
    from runtime.sources import full_model

    if is_lora(source, recipe):
        tensors, lora = adapter_tensors(source, recipe, "export")
        if not merge:
            return build.write_adapter(recipe, tensors, folder, provenance)
        # the base a block at a time, each block merged as it comes
        layout, groups = base_layout(recipe), merged_groups(tensors, lora, recipe)
        return build.write_model(full_model(recipe), groups, layout, folder, provenance)
    # read a block at a time, in the dtype the folder is written in, each safetensors file
    # written as it fills: host memory holds a file's weights, whatever the model's size
    layout, groups = hf_weight_groups(
        source, recipe, command="export", dtype=DTYPES[recipe.model.dtype]
    )
    return build.write_model(recipe, groups, layout, folder, provenance)


# What a model folder needs free beyond its weights (index, config, tokenizer files).
ROOM_MARGIN_BYTES = 100e6


def room_short(folder: Path, nbytes: float) -> str | None:
    """Where the filesystem that would hold `folder` has no room for `nbytes` of model: what
    is free and what is needed, for a message; None where it has, or gives no size."""
    from runtime.control.checkpoint import approx_size, free_bytes

    free = free_bytes(folder)
    if free is None or free >= nbytes + ROOM_MARGIN_BYTES:
        return None
    return f"has {approx_size(free).lstrip('~')} free and the model needs {approx_size(nbytes)}"


def check_room(folder: Path, nbytes: float, *, what: str) -> None:
    """A UserError where the model cannot fit: found before anything is read or written."""
    short = room_short(folder, nbytes)
    if short:
        raise UserError(f"{what} {short}; name a folder on a disk with room")


def check_repo_id(repo: str) -> None:
    """A Hub repository name as the Hub takes it (`owner/name` or `name`), checked offline."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        first = str(e).split(". ")[0]
        raise UserError(
            f"export: --push-to-hub {repo!r} is not a Hub repository name: {first}"
        ) from None


def push(folder: Path, repo: str, token: str | None) -> str:
    """Upload the folder to the Hub repository `repo` (made private if it does not exist)."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        api.create_repo(repo, private=True, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="forgesky export")
    except HfHubHTTPError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"export: the Hub refused {repo} ({first}); the model is in {folder}"
        ) from None
    except (OSError, httpx.HTTPError) as e:  # no network, DNS, a proxy: the Hub was not reached
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"export: could not reach the Hub to push {repo} ({type(e).__name__}: {first}); "
            f"the model is in {folder}: push it later with `hf upload {repo} {folder}`"
        ) from None
    return f"https://huggingface.co/{repo}"
