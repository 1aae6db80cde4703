"""Choices the command line offers before anything heavy is imported (launcher/options.py checks
the values they lead to)."""

RECOVERY_STRATEGIES = ("eager_next_region", "failover")
WANDB_MODES = ("online", "offline", "disabled")
