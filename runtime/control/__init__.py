"""The controller process: start the services of a plan, run rollouts and training steps, keep
the run's state (rollout buffer, checkpoints, metrics)."""
