"""Processes and nodes: Monarch proc meshes pinned to their GPUs, the one way a run ends,
worker nodes and their heartbeats, and what a run leaves on its host."""
