"""The tasks forgesky ships, by name: `builtin:<name>` in a recipe (dataset.path, a reward,
model.tokenizer) resolves here and nowhere else.

A shipped task is its prompt rows, optionally its reward and its tokenizer. Each lives in a
package of its own (runtime/tasks/<name>/) that is imported only when a recipe names it, so a
reward proc scoring GSM8K never imports the tiny task's tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

from recipes.errors import UserError
from recipes.names import BUILTIN_TASKS
from runtime.tasks.shipped import ShippedTask


def _tiny() -> ShippedTask:
    from runtime.tasks.tiny import SHIPPED

    return SHIPPED


def _arith() -> ShippedTask:
    from runtime.tasks.arith import SHIPPED

    return SHIPPED


def _tiny_tools() -> ShippedTask:
    from runtime.tasks.tiny_tools import SHIPPED

    return SHIPPED


_LOADERS: dict[str, Callable[[], ShippedTask]] = {
    "tiny": _tiny,
    "arith": _arith,
    "tiny-tools": _tiny_tools,
}


def shipped_task(name: str, *, field: str) -> ShippedTask:
    """The shipped task `name`; `field` (e.g. "dataset.path") names where a recipe asked for it."""
    loader = _LOADERS.get(name)
    if loader is None:
        raise UserError(
            f"{field} 'builtin:{name}': no shipped task named {name!r} "
            f"(shipped: {', '.join(BUILTIN_TASKS)})"
        )
    return loader()
