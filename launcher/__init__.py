"""Laptop side of forgesky: the `forgesky` CLI and the SkyPilot task builder."""
