"""Environments of multi-turn episodes: what a rollout asks of them (api.py) and the workers
that host them beside the generator."""
