"""The losses against a widely used peer implementation (verl's `core_algos`, 0.9.1) on random
ragged batches with empty responses: values and gradients agree under the conventions our
docstrings state; and hand-computed values for what the peer does differently."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import numpy as np
import pytest
import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

from runtime.backends.base import token_entropy
from runtime.grpo import group_advantages, kl_per_token, policy_loss, resolve_loss

B, P, R = 7, 3, 9  # sequences, prompt tokens, response tokens
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def batch(seed: int):
    """Our [B, P + R] layout and verl's [B, R] response-only views of the same numbers."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, R + 1, (B,), generator=g)
    lengths[1] = 0  # an empty response, always
    lengths[2] = R
    resp_mask = torch.arange(R)[None, :] < lengths[:, None]
    lp = -torch.rand(B, R, generator=g) * 2 - 0.05
    old = lp + 0.35 * torch.randn(B, R, generator=g)  # ratios well past both clips
    ref = lp + 0.3 * torch.randn(B, R, generator=g)
    adv = torch.randn(B, generator=g)
    full = torch.zeros(B, P + R)
    mask = torch.zeros(B, P + R, dtype=torch.bool)
    mask[:, P:] = resp_mask

    def ours(x):
        y = full.clone()
        y[:, P:] = x
        return y

    return {
        "ours": (ours(lp), ours(old), ours(ref), adv, mask),
        "verl": (lp, old, ref, adv, resp_mask),
    }


def verl_config(**extra):
    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        clip_ratio=CLIP_LOW,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_c=1e9,  # no dual clip: ours has none
        ppo_micro_batch_size_per_gpu=1,
        use_dynamic_bsz=False,
        **extra,
    )


# ours: (variant, verl function, verl aggregation, verl global_batch_info)
PEERS = {
    "grpo": ("compute_policy_loss_vanilla", "seq-mean-token-mean", {"global_batch_size": B}),
    "dr_grpo": (
        "compute_policy_loss_vanilla",
        "seq-mean-token-sum-norm",
        {"global_batch_size": B, "loss_scale_factor": R},
    ),
    "dapo": ("compute_policy_loss_vanilla", "token-mean", {}),
    "gspo": ("compute_policy_loss_gspo", "seq-mean-token-mean", {"global_batch_size": B}),
    "cispo": ("compute_policy_loss_cispo", "token-mean", {}),
    "sapo": ("compute_policy_loss_sapo", "seq-mean-token-mean", {"global_batch_size": B}),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", list(PEERS))
def test_each_loss_and_its_gradient_agree_with_verl(variant, seed):
    """B counts every sequence (ours) = verl's global_batch_size given as B (verl's own default
    leaves empty sequences out of it); no dual clip; equal clips low and high as configured."""
    data = batch(seed)
    lp, old, _, adv, mask = data["ours"]
    lp = lp.clone().requires_grad_(True)
    ours, stats = policy_loss(
        lp, old, None, adv, mask, variant=variant, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
        max_response_tokens=R,
    )  # fmt: skip
    (g_ours,) = torch.autograd.grad(ours, lp)

    vlp, vold, _, vadv, vmask = data["verl"]
    vlp = vlp.clone().requires_grad_(True)
    name, mode, info = PEERS[variant]
    config = dataclasses.replace(verl_config(), global_batch_info=info)
    theirs, _ = getattr(core_algos, name)(
        vold, vlp, vadv[:, None].expand(B, R) * vmask, vmask, loss_agg_mode=mode, config=config
    )
    (g_theirs,) = torch.autograd.grad(theirs, vlp)

    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ours[:, P:], g_theirs, rtol=1e-5, atol=1e-7)
    assert (g_ours[:, :P] == 0).all() and (g_ours[1] == 0).all()  # prompt, empty response
    assert stats["response_tokens"] == mask.sum().item()


@pytest.mark.parametrize("estimator, theirs", [("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl")])
def test_kl_estimators_agree_with_verl(estimator, theirs):
    data = batch(5)
    lp, _, ref, _, mask = data["ours"]
    vlp, _, vref, _, vmask = data["verl"]
    ours = kl_per_token(lp, ref, mask, estimator)[:, P:]
    expected = core_algos.kl_penalty_forward(vlp, vref, theirs) * vmask
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_agree_with_verl_under_the_sample_std(scale):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 3, (5 * 4,), generator=g).float()
    rewards[:4] = 1.0  # a group of equal rewards: advantages 0
    ours = group_advantages(rewards, 4, scale_by_std=scale, std="sample")
    token_rewards = torch.zeros(20, 3)
    token_rewards[:, -1] = rewards
    index = [i // 4 for i in range(20)]
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, torch.ones(20, 3), np.array(index), norm_adv_by_std_in_grpo=scale
    )
    torch.testing.assert_close(ours, theirs[:, 0])
    assert (ours[:4] == 0).all()
    # our default is the population std: the same centring, a larger scale
    pop = group_advantages(rewards, 4)
    assert (pop.abs() >= ours.abs() - 1e-6).all()


def test_entropy_agrees_with_verl():
    logits = torch.randn(4, 6, 11, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(token_entropy(logits), verl_F.entropy_from_logits(logits))
    torch.testing.assert_close(
        token_entropy(logits, temperature=0.5), verl_F.entropy_from_logits(logits / 0.5)
    )


# --- by hand ------------------------------------------------------------------------------------


def test_gspo_gives_a_sequence_without_response_tokens_nothing():
    """B = 2, one empty sequence with A = 1 and one on-policy sequence with A = 0: the loss is
    0 (the empty sequence's ratio used to count as 1 and add -A/B = -0.5)."""
    lp = torch.tensor([[-1.0, -1.0], [-0.5, -0.7]], requires_grad=True)
    mask = torch.tensor([[False, False], [True, True]])
    loss, _ = policy_loss(lp, lp.detach(), None, torch.tensor([1.0, 0.0]), mask, variant="gspo")
    assert loss.item() == 0.0


def test_dapo_is_a_token_mean_over_the_whole_batch():
    """On-policy (ratio 1): loss = -sum_tokens(A) / tokens; a long sequence weighs more."""
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(lp, None, None, adv, mask, variant="dapo")
    assert loss.item() == pytest.approx(-(4 * 1.0 - 1.0) / 5)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, -adv[:, None] / 5 * mask)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """A token whose ratio is past the clip still gets a gradient, scaled by the clipped weight
    (PPO's clip would give it none)."""
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]])  # ratio e on token 0, 1 on token 1
    adv = torch.tensor([2.0])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = policy_loss(lp, old, None, adv, mask, variant="cispo", clip_high=0.28)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([[-1.28 * 2 / 2, -1.0 * 2 / 2]]))
    assert stats["clip_fraction/high"] == 0.5
    ppo, _ = policy_loss(lp, old, None, adv, mask, variant="dapo", clip_high=0.28)
    (g_ppo,) = torch.autograd.grad(ppo, lp)
    assert g_ppo[0, 0] == 0 and g_ppo[0, 1] != 0


def test_sapo_gate_is_the_ratio_near_one_and_fades_away_from_it():
    """d/dr of sigmoid(tau (r - 1)) 4 / tau is 1 at r = 1 and decays on both sides."""
    mask = torch.ones(1, 1, dtype=torch.bool)

    def grad_at(r: float) -> float:
        lp = torch.tensor([[math.log(r)]], requires_grad=True)
        loss, _ = policy_loss(lp, torch.zeros(1, 1), None, torch.ones(1), mask, variant="sapo")
        (g,) = torch.autograd.grad(loss, lp)
        return -g.item() / r  # d loss / d r = d loss / d lp / r

    assert grad_at(1.0) == pytest.approx(1.0)
    assert grad_at(1.5) < grad_at(1.2) < 1.0 and grad_at(0.5) < grad_at(0.8) < 1.0


def test_kl_and_entropy_terms_use_the_losses_aggregation():
    lp = torch.full((1, 3), -1.0, requires_grad=True)
    ref = torch.full((1, 3), -1.5)
    entropy = torch.full((1, 3), 2.0)
    mask = torch.ones(1, 3, dtype=torch.bool)
    base, _ = policy_loss(lp, None, None, torch.zeros(1), mask)
    with_kl, stats = policy_loss(lp, None, ref, torch.zeros(1), mask, kl_beta=0.5)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * k3)
    assert stats["kl"] == pytest.approx(k3)
    bonus, stats = policy_loss(
        lp, None, None, torch.zeros(1), mask, entropy=entropy, entropy_coef=0.1
    )
    assert bonus.item() == pytest.approx(base.item() - 0.2)
    assert stats["entropy"] == pytest.approx(2.0)
    k1, stats = policy_loss(lp, None, ref, torch.zeros(1), mask, kl_beta=1.0, kl_estimator="k1")
    assert stats["kl"] == pytest.approx(0.5)


# --- your own loss ------------------------------------------------------------------------------


def test_a_loss_of_your_own_by_module_and_function(monkeypatch):
    module = types.ModuleType("mylosses")

    def reinforce(inputs, config):
        return -inputs.advantages[:, None] * inputs.logprobs, {"mine": 1.0}

    def wrong(inputs):
        return inputs.logprobs.sum(), {}

    module.reinforce, module.wrong = reinforce, wrong
    monkeypatch.setitem(sys.modules, "mylosses", module)
    lp = torch.full((2, 2), -1.0, requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, stats = policy_loss(
        lp, None, None, torch.tensor([1.0, 3.0]), mask, variant="mylosses:reinforce"
    )
    # per token -A * lp = A, aggregated as a sequence mean (the default): (1 + 3) / 2
    assert loss.item() == pytest.approx(2.0) and stats["mine"] == 1.0
    with pytest.raises(ValueError, match=r"must take \(inputs, config\)"):
        resolve_loss("mylosses:wrong")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_loss("mylosses:nope")
    with pytest.raises(ValueError, match="module 'nosuchmodule' not found"):
        resolve_loss("nosuchmodule:f")
