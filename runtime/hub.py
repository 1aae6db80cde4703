"""The Hugging Face Hub as commands meet it: the token a run or an export uses (HF_TOKEN, or
HUGGING_FACE_HUB_TOKEN, read from the environment like every Hub client), and loads that fail in
one line of ours rather than a line per retry. A module of its own so that commands can check
the token before loading torch."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator


def hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


UNREACHABLE = "the Hugging Face Hub could not be reached"  # how a load's line says it

_WHY = re.compile(r"^'(?P<why>.+)' thrown while requesting ")


@contextlib.contextmanager
def quiet_retries() -> Iterator[list[str]]:
    """Hold back huggingface_hub's lines about failed requests and retries (printed before the
    one line a failed load ends with) for the block. Yields the list of why each request failed
    (e.g. `[Errno 111] Connection refused`), for that line; any other warning is passed on."""
    logger = logging.getLogger("huggingface_hub")
    reasons: list[str] = []
    kept: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if match := _WHY.match(message):
                reasons.append(match.group("why"))
            elif not message.startswith("Retrying in "):
                kept.append(record)

    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [Hold()], False
    try:
        yield reasons
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        for record in kept:
            logger.handle(record)
