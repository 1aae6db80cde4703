"""The weights `forgesky eval` and `forgesky export` read from a SOURCE (runtime.evaluate.Source):
a model folder or a checkpoint, checked against the recipe's architecture before anything large
is read, under Hugging Face names, whole or a block at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recipes import UserError

if TYPE_CHECKING:
    from runtime.evaluate import Source


def load_hf_weights(source: Source, recipe: Any, command: str = "eval") -> dict[str, Any]:
    """The model's weights under HF names, checked against the recipe's architecture."""
    from runtime.backends import build
    from runtime.models.hf import from_hf, to_hf
    from runtime.models.loading import check_config, load_hf_state_dict

    spec = build.model_spec(recipe)
    where = f"{command}: the weights in {source.path}"
    if source.kind == "hf":
        check_config(source.path, spec, str(source.path))
        titan = from_hf(load_hf_state_dict(str(source.path)), spec)
        _check_fit(_shapes(titan), _expected(spec, fused=False), where, recipe)
        return to_hf(dict(titan), spec)
    from runtime.backends import trainer_state

    legacy = trainer_state.is_legacy(source.path)
    try:
        if not legacy:
            # names and shapes from the metadata first: a wrong --recipe reads nothing
            _check_fit(
                trainer_state.saved_shapes(source.path), _expected(spec, fused=True), where, recipe
            )
        titan = trainer_state.model_weights(source.path, spec)
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
    from runtime.backends import build, trainer_state
    from runtime.models.hf import to_hf

    if source.kind == "hf" or trainer_state.is_legacy(source.path):
        whole = load_hf_weights(source, recipe, command)
        return {k: v.to("meta") for k, v in whole.items()}, iter([whole])
    spec = build.model_spec(recipe)
    where = f"{command}: the weights in {source.path}"
    try:
        # names and shapes from the metadata first: a wrong --recipe reads nothing
        _check_fit(
            trainer_state.saved_shapes(source.path), _expected(spec, fused=True), where, recipe
        )
        layout, groups = trainer_state.model_weight_groups(source.path, spec, dtype)
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
