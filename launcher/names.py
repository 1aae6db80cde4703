"""Choices the command line offers before anything heavy is imported (launcher/options.py checks
the values they lead to)."""

RECOVERY_STRATEGIES = ("eager_next_region", "failover")
WANDB_MODES = ("online", "offline", "disabled")
# The header line that tells a file `forgesky render -o FILE` wrote (and may write again) from
# one it must not overwrite, such as the recipe itself.
RENDERED_MARK = "Written by "
PROG = "forgesky"
