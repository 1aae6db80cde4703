"""Loads from a Hugging Face Hub that cannot be reached end in one line of ours that says so,
without huggingface_hub's line per failed request and retry before it. The Hub here is an
address that refuses connections (HF_ENDPOINT), with an empty cache (HF_HOME)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
from recipes import UserError, apply_overrides, load_recipe
from runtime.backends.build import load_tokenizer
from runtime.models.loading import snapshot
from runtime.tasks.data import load_hf_dataset

recipe = load_recipe("qwen3-1.7b")
loads = {
    "dataset": lambda: load_hf_dataset("openai/gsm8k", "main", "test"),
    "model": lambda: snapshot("Qwen/Qwen3-1.7B"),
    "tokenizer": lambda: load_tokenizer(recipe),
    "tokenizer_random_init": lambda: load_tokenizer(
        apply_overrides(recipe, ["model.init=random"])
    ),
}
said = {}
for name, load in loads.items():
    try:
        load()
        said[name] = "loaded"
    except UserError as e:
        said[name] = str(e)
print(json.dumps(said))
"""


def test_an_unreachable_hub_is_named_in_one_line(tmp_path):
    env = {
        **os.environ,
        "HF_ENDPOINT": "http://127.0.0.1:9",  # the discard port: connection refused
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_DATASETS_OFFLINE", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.strip().splitlines()[-1])
    refused = "the Hugging Face Hub could not be reached"
    assert said["dataset"].startswith(f"dataset 'openai/gsm8k': {refused}: ")
    assert "Connection refused" in said["dataset"]
    assert said["dataset"].endswith("or use a local file (dataset.path=FILE.jsonl)")
    assert said["model"].startswith(f"model Qwen/Qwen3-1.7B: {refused} (")
    assert (
        "Connection refused" in said["model"]
        and "set model.hf_id to a local folder" in said["model"]
    )
    assert said["tokenizer"].startswith(f"model.tokenizer 'Qwen/Qwen3-1.7B': {refused} (")
    assert said["tokenizer_random_init"].endswith("--set model.tokenizer=builtin:arith")
    assert refused in said["tokenizer_random_init"]
    # huggingface_hub's own lines (a request that failed, a retry) were held back
    assert "thrown while requesting" not in done.stderr, done.stderr
    assert "Retrying in" not in done.stderr, done.stderr


def test_other_hub_warnings_still_reach_the_log(caplog):
    import logging

    from runtime.hub import quiet_retries

    logger = logging.getLogger("huggingface_hub.utils._http")
    with caplog.at_level(logging.WARNING), quiet_retries() as failed:
        logger.warning("'[Errno 111] Connection refused' thrown while requesting HEAD http://x/y")
        logger.warning("Retrying in 1s [Retry 1/5].")
        logger.warning("something else worth reading")
        assert "something else" not in caplog.text  # held back until the block ends
    assert failed == ["[Errno 111] Connection refused"]
    assert "something else worth reading" in caplog.text
    assert "Retrying in" not in caplog.text and "thrown while requesting" not in caplog.text
