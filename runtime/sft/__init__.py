"""Supervised fine-tuning: chat rows rendered by the family's chat template, the loss on the
assistant's tokens only, rows packed into micro-batches (data.py), and the run (run.py)."""
