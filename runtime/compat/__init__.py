"""Compatibility shims for upstream packages whose released versions lag the stack we run."""
