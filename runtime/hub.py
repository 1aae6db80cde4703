"""The Hugging Face token a run or an export uses: HF_TOKEN (or HUGGING_FACE_HUB_TOKEN), read
from the environment like every Hub client. A module of its own so that commands can check it
before loading torch."""

from __future__ import annotations

import os


def hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
