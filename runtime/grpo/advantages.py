"""Group-relative advantages: one number per completion, from the rewards of its group."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

Std = Literal["population", "sample"]


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    *,
    scale_by_std: bool = True,
    std: Std = "population",
    eps: float = 1e-6,
) -> Tensor:
    """`(r - mean) / (std + eps)` per group, or `r - mean` without `scale_by_std` (Dr.GRPO).

    `rewards` is `[num_groups, group_size]`, or flat `[num_groups * group_size]` with `group_size`
    given (completions of one prompt contiguous); the result has the shape of the input.

    `std` is the population std by default (divide by `group_size`): a group's advantages then
    have mean 0 and root-mean-square 1 whatever the group size, so the loss scale does not depend
    on it. "sample" divides by `group_size - 1` (what TRL and verl do). A group whose rewards are
    all equal gets advantages of 0 either way.
    """
    if rewards.dim() == 1:
        if group_size is None:
            raise ValueError("flat rewards need group_size")
        if rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
        grouped = rewards.reshape(-1, group_size)
    elif rewards.dim() == 2:
        if group_size is not None and rewards.shape[1] != group_size:
            raise ValueError(f"rewards {tuple(rewards.shape)} do not match group_size {group_size}")
        grouped = rewards
    else:
        raise ValueError(f"rewards must be 1-D or 2-D, got shape {tuple(rewards.shape)}")
    if std not in ("population", "sample"):
        raise ValueError(f"std must be 'population' or 'sample', got {std!r}")

    grouped = grouped.float()
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        correction = 0 if std == "population" else 1
        centered = centered / (grouped.std(dim=1, correction=correction, keepdim=True) + eps)
    return centered.reshape(rewards.shape)


def informative(rewards: Tensor, group_size: int) -> Tensor:
    """Per group, whether its rewards differ (a group of equal rewards has no learning signal:
    DAPO's dynamic sampling drops it). `rewards` flat, groups contiguous."""
    grouped = rewards.reshape(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
