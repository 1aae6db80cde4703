"""Benchmarks of forgesky on CPU and GPU machines (each file runs as a script); a package so
that a recipe can name `bench.rewards:...` as a reward."""
