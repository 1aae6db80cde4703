"""Per-token estimators of KL(policy || reference) from the two log-probs of the sampled token
(http://joschu.net/blog/kl-approx.html), with `d = ref - lp`:

- k1: `-d` (unbiased, high variance, can be negative);
- k2: `d^2 / 2` (biased, low variance; its gradient is the KL's gradient to first order);
- k3: `exp(d) - d - 1` (unbiased, low variance, never negative): the default.

Padded positions may hold anything: they are masked before any exp.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Estimator = Literal["k1", "k2", "k3"]
ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """`[B, T]` KL estimate at response tokens, 0 elsewhere."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    d = torch.where(mask, ref_logprobs.detach().to(logprobs.dtype) - logprobs, zero)
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d.square()
    elif estimator == "k3":
        kl = torch.exp(d) - d - 1.0
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")
    return kl * mask
