"""The one exception type for mistakes a user can fix (bad recipe, impossible GPU count, ...),
and the argument parser whose mistakes read the same way."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UserError(Exception):
    """A mistake the user can fix. The message is one line: what, where, and what to do.

    Entry points print it without a traceback and exit with code 2. Whatever the message quotes
    from the user's input stays on that line: control characters (a newline in a YAML key, say)
    are shown escaped.
    """

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(str(message)))


class DoesNotFit(UserError):
    """A layout or a setting whose memory does not fit its GPUs; the message is the arithmetic."""


def one_line(text: str) -> str:
    """`text` with every character that would not print as itself (a newline in a YAML key, an
    escape sequence, invisible spacing) written as its escape (`\\n`, `\\x1b`, `\\u3000`)."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


class OneLineParser(argparse.ArgumentParser):
    """argparse with mistakes on one line (what, and where to read more), exit code 2."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            # `--set a=1 b=2`: a --set takes one KEY=VALUE
            loose = [w for w in message.split(": ", 1)[1].split() if "=" in w and w[0] != "-"]
            if loose:
                message += f"; each KEY=VALUE takes a --set of its own (--set {loose[0]})"
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")
