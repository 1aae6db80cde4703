"""The one exception type for mistakes a user can fix (bad recipe, impossible GPU count, ...)."""


class UserError(Exception):
    """A mistake the user can fix. The message is one line: what, where, and what to do.

    Entry points print it without a traceback and exit with code 2.
    """
