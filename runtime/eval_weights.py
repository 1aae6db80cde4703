"""The weights `forgesky eval` and `forgesky export` read from a SOURCE (runtime.sources.Source):
a model folder or a checkpoint, checked against the recipe's architecture before anything large
is read, under Hugging Face names, whole or a block at a time. A LoRA adapter (an adapter folder,
or the checkpoint of a LoRA run) is merged into the recipe's base: its Hub checkpoint, or the
seeded initialisation a random-init run started from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recipes import UserError

if TYPE_CHECKING:
    from runtime.sources import Source


def load_hf_weights(source: Source, recipe: Any, command: str = "eval") -> dict[str, Any]:
    """The model's weights under HF names, checked against the recipe's architecture."""
    from runtime.backends import build
    from runtime.models.hf import from_hf, to_hf
    from runtime.models.loading import check_config, load_hf_state_dict

    spec = build.model_spec(recipe)
    where = f"{command}: the weights in {source.path}"
    if is_lora(source, recipe):
        tensors, lora = adapter_tensors(source, recipe, command)
        state: dict[str, Any] = {}
        for group in merged_groups(tensors, lora, recipe):
            state.update(group)
        return state
    if source.kind == "hf":
        check_config(source.path, spec, str(source.path))
        titan = from_hf(load_hf_state_dict(str(source.path)), spec)
        _check_fit(_shapes(titan), _expected(spec, fused=False), where, recipe)
        return to_hf(dict(titan), spec)
    from runtime.backends import checkpoint_read

    legacy = checkpoint_read.is_legacy(source.path)
    try:
        if not legacy:
            # names and shapes from the metadata first: a wrong --recipe reads nothing
            _check_fit(
                checkpoint_read.saved_shapes(source.path),
                _expected(spec, fused=True),
                where,
                recipe,
            )
        titan = checkpoint_read.model_weights(source.path, spec)
    except UserError:
        raise
    except _unreadable() as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise _cannot_read(command, source, e) from None
    if legacy:
        _check_fit(_shapes(titan), _expected(spec, fused=False), where, recipe)
    return to_hf(dict(titan), spec)


def hf_weight_groups(source: Source, recipe: Any, command: str, dtype: Any) -> tuple[Any, Any]:
    """`load_hf_weights` a group at a time, for an export: (the HF names and shapes as meta
    tensors in the order they come, the groups). A DCP checkpoint is checked against the
    recipe first, then read one block at a time into `dtype`; anything else is read whole (the
    writer casts it)."""
    from runtime.backends import build, checkpoint_read
    from runtime.models.hf import to_hf

    if source.kind == "hf" or checkpoint_read.is_legacy(source.path):
        whole = load_hf_weights(source, recipe, command)
        return {k: v.to("meta") for k, v in whole.items()}, iter([whole])
    spec = build.model_spec(recipe)
    where = f"{command}: the weights in {source.path}"
    try:
        # names and shapes from the metadata first: a wrong --recipe reads nothing
        _check_fit(
            checkpoint_read.saved_shapes(source.path), _expected(spec, fused=True), where, recipe
        )
        layout, groups = checkpoint_read.model_weight_groups(source.path, spec, dtype)
    except UserError:
        raise
    except _unreadable() as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise _cannot_read(command, source, e) from None
    hf_layout = {k: v for part in layout for k, v in to_hf(part, spec).items()}

    def hf_groups() -> Any:
        try:
            for group in groups:
                yield to_hf(group, spec)
        except UserError:
            raise
        except _unreadable() as e:  # noqa: BLE001 - a file that fails half-way is the same error
            raise _cannot_read(command, source, e) from None

    return hf_layout, hf_groups()


def _cannot_read(command: str, source: Source, e: BaseException) -> UserError:
    return UserError(f"{command}: checkpoint {source.path} cannot be read ({_first(e)})")


def _first(e: BaseException) -> str:
    """The first sentence of what went wrong; under DCP's CheckpointException, the error of
    the read that failed (an EOFError for a file cut short)."""
    from torch.distributed.checkpoint import CheckpointException

    from runtime.backends.trainer_state import error_chain

    e = next((x for x in error_chain(e) if not isinstance(x, CheckpointException)), e)
    text = str(e).strip().splitlines()
    return (text[0].split(". ")[0] if text else "") or type(e).__name__


def _unreadable() -> tuple[type[BaseException], ...]:
    """What reading a damaged checkpoint raises: any error, and DCP's CheckpointException,
    which is a BaseException."""
    from torch.distributed.checkpoint import CheckpointException

    return (Exception, CheckpointException)


def _shapes(tensors: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _expected(spec: Any, *, fused: bool) -> dict[str, tuple[int, ...]]:
    """The recipe model's tensors (built on meta): its parameters as the model holds them
    (`fused`: q/k/v in one projection, what a DCP checkpoint stores) or its state dict."""
    from runtime.models.titan import meta_model

    model = meta_model(spec)  # tied: one parameter, as a live model saves it
    tensors = dict(model.named_parameters()) if fused else model.state_dict()
    return _shapes(tensors)


def _check_fit(
    got: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], what: str, recipe: Any
) -> None:
    """UserError unless the names and shapes are exactly the recipe model's."""
    model = f"{recipe.model.family} {recipe.model.size}"
    if got.keys() != expected.keys():
        odd = sorted(got.keys() ^ expected.keys())[:3]
        raise UserError(
            f"{what} are not a {model} model (names differ: {', '.join(odd)}); check --recipe"
        )
    wrong = [k for k in expected if got[k] != expected[k]]
    if wrong:
        k = wrong[0]
        raise UserError(
            f"{what} are not a {model} model ({k} is {list(got[k])}, the recipe's model has "
            f"{list(expected[k])}); check --recipe"
        )


# --- LoRA: an adapter and the base it is merged into -------------------------------------------


def is_lora(source: Source, recipe: Any) -> bool:
    """Whether SOURCE holds a LoRA adapter (a folder of one, or a LoRA run's checkpoint)."""
    return source.kind == "adapter" or (
        source.kind == "checkpoint" and recipe.model.lora is not None
    )


def adapter_tensors(source: Source, recipe: Any, command: str) -> tuple[dict[str, Any], Any]:
    """(the adapter SOURCE holds, under PEFT names in fp32; its LoRA), checked against the
    recipe's model; UserError for what does not fit."""
    from runtime.backends import build
    from runtime.models.peft_format import CONFIG_FILE, check_adapter, lora_of, read_adapter_folder

    spec = build.model_spec(recipe)
    if source.kind != "adapter":
        return _checkpoint_adapter(source, recipe, command), recipe.model.lora
    where = f"{command}: {source.path / CONFIG_FILE}"
    try:
        tensors, config = read_adapter_folder(source.path)
    except (OSError, ValueError) as e:
        raise UserError(f"{command}: adapter {source.path} cannot be read ({_first(e)})") from None
    lora = lora_of(config, where)
    got, base = config.get("base_model_name_or_path"), build.base_id(recipe)
    if got != base:
        mine = base or f"its random init (model.init random, {recipe.model.hf_id})"
        raise UserError(
            f"{where}: the adapter's base is {got or 'a random init'} and recipe "
            f"{recipe.name}'s base is {mine}; pass --recipe with the adapter's base model"
        )
    try:
        check_adapter(tensors, spec, lora)
    except KeyError as e:
        model = f"{recipe.model.family} {recipe.model.size}"
        raise UserError(
            f"{command}: adapter {source.path} is not one of a {model} model "
            f"({e.args[0].removeprefix('the adapter does not fit: ')}); check --recipe"
        ) from None
    return {k: v.float() for k, v in tensors.items()}, lora


def _checkpoint_adapter(source: Source, recipe: Any, command: str) -> dict[str, Any]:
    """The adapter a LoRA run's checkpoint holds, under PEFT names in fp32."""
    from runtime.backends import build
    from runtime.backends.checkpoint_read import adapter_weights
    from runtime.models.lora import peft_state

    spec = build.model_spec(recipe)
    try:
        titan = adapter_weights(source.path)
    except UserError:
        raise
    except _unreadable() as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise _cannot_read(command, source, e) from None
    peft = peft_state(titan, recipe.model.family, recipe.model.lora, spec)
    return {k: v.float() for k, v in peft.items()}


def base_groups(recipe: Any) -> Any:
    """The recipe's base model under HF names, a group at a time (the tensors outside the
    blocks, then one block a group): its Hub checkpoint, or the seeded initialisation a
    random-init run starts from."""
    from runtime.backends import build
    from runtime.models.hf import to_hf
    from runtime.models.loading import SeededWeights

    spec = build.model_spec(recipe)
    source = build.initial_weights(recipe, spec) or SeededWeights(spec, recipe.seed)
    for group in source.groups():
        yield to_hf(group, spec)


def base_layout(recipe: Any) -> dict[str, Any]:
    """The names and shapes (meta tensors) of `base_groups`, in the order they come."""
    from runtime.backends import build
    from runtime.models.hf import to_hf
    from runtime.models.loading import GivenWeights
    from runtime.models.titan import meta_model

    spec = build.model_spec(recipe)
    groups = GivenWeights(meta_model(spec).state_dict()).groups()
    return {k: v for group in groups for k, v in to_hf(group, spec).items()}


def merged_groups(tensors: dict[str, Any], lora: Any, recipe: Any) -> Any:
    """The recipe's base with the adapter merged in, a group at a time (HF names, fp32 math)."""
    from runtime.models.peft_format import merge_groups

    return merge_groups(base_groups(recipe), tensors, lora)
