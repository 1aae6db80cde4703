"""GRPO math against hand-computed values and hand-derived gradients on tiny tensors."""

import math

import pytest
import torch

from runtime.grpo import group_advantages, policy_loss

CLIP = {"clip_low": 0.2, "clip_high": 0.3}


def leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32, requires_grad=True)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


# ---------------------------------------------------------------- advantages


def test_advantages_use_population_std():
    adv = group_advantages(torch.tensor([[0.0, 0.0, 3.0]]), eps=0.0)
    # mean 1, population variance (1 + 1 + 4) / 3 = 2; the unbiased std would be sqrt(3).
    s = math.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([[-1 / s, -1 / s, 2 / s]]))


@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_advantages_have_unit_rms_for_any_group_size(group_size):
    rewards = torch.rand(5, group_size, generator=torch.Generator().manual_seed(group_size))
    adv = group_advantages(rewards, eps=0.0)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(5), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.pow(2).mean(dim=1).sqrt(), torch.ones(5))


def test_advantages_binary_pair_are_plus_minus_one():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)


def test_advantages_flat_matches_grouped():
    rewards = torch.tensor([0.1, 0.5, 0.9, 2.0, 2.0, 4.0])
    flat = group_advantages(rewards, group_size=3)
    grouped = group_advantages(rewards.reshape(2, 3))
    assert flat.shape == (6,)
    torch.testing.assert_close(flat, grouped.reshape(6))


def test_advantages_of_equal_rewards_are_zero():
    adv = group_advantages(torch.tensor([[0.7, 0.7, 0.7, 0.7]]))
    assert torch.equal(adv, torch.zeros(1, 4))


def test_dr_grpo_advantages_are_centered_not_scaled():
    adv = group_advantages(torch.tensor([[0.0, 0.0, 3.0], [1.0, 2.0, 3.0]]), scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, -1.0, 2.0], [-1.0, 0.0, 1.0]]))


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6))
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="group_size 3"):
        group_advantages(torch.zeros(2, 4), group_size=3)


# ---------------------------------------------------------------- grpo loss, on-policy


def test_grpo_on_policy_value_and_gradient():
    lp = leaf([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = policy_loss(lp, lp.detach(), None, adv, mask, variant="grpo", **CLIP)
    # ratio == 1 everywhere: loss = -mean_b(A_b), d loss / d lp[b, t] = -A_b / (len_b * B).
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    expected = torch.tensor([[-2 / 6, -2 / 6, -2 / 6], [1 / 4, 1 / 4, 0.0]])
    torch.testing.assert_close(grad_of(loss, lp), expected)
    assert stats["ratio/mean"] == pytest.approx(1.0)
    assert stats["clip_fraction"] == 0.0
    assert stats["kl"] == 0.0
    assert stats["response_tokens"] == 5.0


def test_old_logprobs_none_means_on_policy():
    lp = leaf([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    a, _ = policy_loss(lp, None, None, torch.tensor([1.5]), mask, **CLIP)
    b, _ = policy_loss(lp, lp.detach(), None, torch.tensor([1.5]), mask, **CLIP)
    assert a.item() == b.item() == pytest.approx(-1.5)


# ---------------------------------------------------------------- clipping


def ratios_to_logprobs(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((1, len(ratios)), -1.0)
    lp = (old + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    return lp, old


def test_positive_advantage_clips_at_one_plus_clip_high():
    lp, old = ratios_to_logprobs([1.5, 1.1, 0.5])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(lp, old, None, torch.tensor([2.0]), mask, **CLIP)
    # r=1.5 > 1.3: clipped to 1.3 (no gradient); r=1.1 inside; r=0.5 below 1-0.2 but A>0 takes
    # the unclipped min, so it keeps its gradient.
    assert loss.item() == pytest.approx(-(1.3 * 2 + 1.1 * 2 + 0.5 * 2) / 3)
    # d(-r*A/3)/d lp = -A * r / 3
    expected = torch.tensor([[0.0, -2 * 1.1 / 3, -2 * 0.5 / 3]])
    torch.testing.assert_close(grad_of(loss, lp), expected)
    assert stats["clip_fraction/high"] == pytest.approx(1 / 3)
    assert stats["clip_fraction/low"] == 0.0
    assert stats["ratio/mean"] == pytest.approx((1.5 + 1.1 + 0.5) / 3)


def test_negative_advantage_clips_at_one_minus_clip_low():
    lp, old = ratios_to_logprobs([0.5, 0.9, 1.5])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(lp, old, None, torch.tensor([-1.0]), mask, **CLIP)
    # r=0.5 < 0.8: clipped to 0.8 (no gradient); r=1.5 above 1+0.3 but A<0 keeps it unclipped.
    assert loss.item() == pytest.approx((0.8 + 0.9 + 1.5) / 3)
    expected = torch.tensor([[0.0, 0.9 / 3, 1.5 / 3]])
    torch.testing.assert_close(grad_of(loss, lp), expected)
    assert stats["clip_fraction/low"] == pytest.approx(1 / 3)
    assert stats["clip_fraction/high"] == 0.0
    assert stats["clip_fraction"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------- masking


def test_mask_excludes_padded_tokens_even_when_they_hold_garbage():
    mask = torch.tensor([[False, True, True, False], [False, False, True, False]])
    adv = torch.tensor([1.0, -0.5])
    clean_lp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, 0.0, -0.4, 0.0]])
    old = torch.tensor([[0.0, -1.1, -1.9, 0.0], [0.0, 0.0, -0.5, 0.0]])
    ref = torch.tensor([[0.0, -0.9, -2.2, 0.0], [0.0, 0.0, -0.3, 0.0]])
    garbage = torch.tensor([[float("-inf"), 0, 0, 55.0], [float("nan"), 9.0, 0, float("-inf")]])
    lp = torch.where(mask, clean_lp, garbage).requires_grad_(True)
    old_g = torch.where(mask, old, -garbage)
    ref_g = torch.where(mask, ref, garbage)
    for variant in ("grpo", "dr_grpo", "gspo"):
        kw = dict(variant=variant, kl_beta=0.1, max_response_tokens=4, **CLIP)
        dirty, dirty_stats = policy_loss(lp, old_g, ref_g, adv, mask, **kw)
        clean_leaf = clean_lp.clone().requires_grad_(True)
        clean, clean_stats = policy_loss(clean_leaf, old, ref, adv, mask, **kw)
        assert torch.isfinite(dirty)
        assert dirty.item() == pytest.approx(clean.item())
        assert dirty_stats == pytest.approx(clean_stats)
        g = grad_of(dirty, lp)
        assert torch.isfinite(g).all()
        assert (g[~mask] == 0).all()
        torch.testing.assert_close(g, grad_of(clean, clean_leaf))


def test_sequence_without_response_tokens_adds_zero():
    lp = leaf([[-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[True, True], [False, False]])
    loss, stats = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([1.0, 5.0]), mask, **CLIP)
    assert loss.item() == pytest.approx(-0.5)
    assert all(math.isfinite(v) for v in stats.values())


# ---------------------------------------------------------------- KL


def test_kl_is_zero_with_zero_gradient_when_policies_are_equal():
    lp = leaf([[-1.0, -2.0, -3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(
        lp, lp.detach(), lp.detach(), torch.zeros(1), mask, kl_beta=0.5, **CLIP
    )
    assert stats["kl"] == 0.0
    assert loss.item() == 0.0
    assert torch.equal(grad_of(loss, lp), torch.zeros(1, 3))


def test_k3_kl_value_and_gradient():
    lp = leaf([[-1.0, -2.0], [-0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -0.5]])
    mask = torch.tensor([[True, True], [True, False]])
    beta = 0.25
    loss, stats = policy_loss(lp, lp.detach(), ref, torch.zeros(2), mask, kl_beta=beta, **CLIP)
    d = torch.tensor([[-0.5, 1.0], [0.0, 0.0]])  # ref - lp
    k3 = torch.exp(d) - d - 1
    # grpo aggregation: mean over tokens of each sequence, then over sequences.
    assert loss.item() == pytest.approx(beta * ((k3[0, 0] + k3[0, 1]) / 2 + 0.0) / 2)
    assert stats["kl"] == pytest.approx(((k3[0, 0] + k3[0, 1]) / 3).item())
    # d k3 / d lp = 1 - exp(ref - lp)
    expected = beta * (1 - torch.exp(d)) / torch.tensor([[4.0, 4.0], [2.0, 2.0]])
    expected[1, 1] = 0.0
    torch.testing.assert_close(grad_of(loss, lp), expected)


def test_kl_is_reported_but_not_trained_when_beta_is_zero():
    lp = leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = policy_loss(lp, lp.detach(), ref, torch.zeros(1), mask, kl_beta=0.0, **CLIP)
    assert stats["kl"] > 0
    assert loss.item() == 0.0
    assert torch.equal(grad_of(loss, lp), torch.zeros(1, 2))


# ---------------------------------------------------------------- Dr.GRPO


def test_dr_grpo_uses_constant_normaliser():
    lp = leaf([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    adv = torch.tensor([1.0, 1.0])
    loss, _ = policy_loss(
        lp, lp.detach(), None, adv, mask, variant="dr_grpo", max_response_tokens=8, **CLIP
    )
    # sum over 6 response tokens of -A, divided by B * max_response_tokens = 16.
    assert loss.item() == pytest.approx(-6 / 16)
    # every token weighs the same whatever its sequence's length
    expected = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, 0.0, 0.0]]) / 16
    torch.testing.assert_close(grad_of(loss, lp), expected)

    grpo, _ = policy_loss(lp, lp.detach(), None, adv, mask, variant="grpo", **CLIP)
    g = grad_of(grpo, lp)
    assert g[1, 0] == pytest.approx(2 * g[0, 0].item())  # grpo weighs short sequences' tokens more


def test_dr_grpo_needs_max_response_tokens():
    lp = leaf([[-1.0]])
    with pytest.raises(ValueError, match="max_response_tokens"):
        policy_loss(
            lp, None, None, torch.ones(1), torch.ones(1, 1, dtype=torch.bool), variant="dr_grpo"
        )


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_value_and_gradient():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    log_ratios = torch.tensor([[0.3, -0.1, 0.0], [0.05, 0.0, 0.0]])
    lp = (old + log_ratios).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = torch.tensor([1.0, 2.0])
    loss, stats = policy_loss(
        lp, old, None, adv, mask, variant="gspo", clip_low=0.05, clip_high=0.05
    )
    s0 = math.exp((0.3 - 0.1) / 2)  # 1.105 > 1.05: clipped for A > 0
    s1 = math.exp(0.05 / 3)  # 1.0168: inside
    assert loss.item() == pytest.approx(-(1.05 * 1.0 + s1 * 2.0) / 2)
    # d s / d lp[t] = s / len for each response token of the sequence
    expected = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]) * (-2.0 * s1 / 3 / 2)
    torch.testing.assert_close(grad_of(loss, lp), expected)
    assert stats["ratio/mean"] == pytest.approx((s0 + s1) / 2)
    assert stats["clip_fraction/high"] == pytest.approx(0.5)


def test_gspo_ratio_is_one_number_per_sequence():
    # Two tokens whose ratios cancel: per-token GRPO sees one token clipped, GSPO sees ratio 1.
    old = torch.tensor([[-1.0, -1.0]])
    lp = (old + torch.tensor([[0.5, -0.5]])).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, gspo = policy_loss(lp, old, None, torch.ones(1), mask, variant="gspo", **CLIP)
    _, grpo = policy_loss(lp, old, None, torch.ones(1), mask, variant="grpo", **CLIP)
    assert gspo["ratio/mean"] == pytest.approx(1.0)
    assert gspo["clip_fraction"] == 0.0
    assert grpo["clip_fraction"] == pytest.approx(0.5)


# ---------------------------------------------------------------- behaviour


@pytest.mark.parametrize("variant", ["grpo", "dr_grpo", "gspo"])
def test_gradient_step_raises_logprob_of_positive_advantage_sequence(variant):
    torch.manual_seed(0)
    vocab, steps = 5, 4
    tokens = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    logits = torch.randn(2, steps, vocab, requires_grad=True)

    def seq_logprobs(lg):
        return torch.log_softmax(lg, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)

    mask = torch.ones(2, steps, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    before = seq_logprobs(logits).detach()
    lp = seq_logprobs(logits)
    loss, _ = policy_loss(
        lp,
        before,
        before,
        adv,
        mask,
        variant=variant,
        kl_beta=0.01,
        max_response_tokens=steps,
        **CLIP,
    )
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    after = seq_logprobs(logits).detach()
    assert after[0].sum() > before[0].sum()
    assert after[1].sum() < before[1].sum()


@pytest.mark.parametrize("variant", ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo"])
def test_micro_batches_sum_to_the_whole_batch(variant):
    gen = torch.Generator().manual_seed(1)
    lp = (-torch.rand(4, 5, generator=gen)).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(4, 5, generator=gen)
    ref = lp.detach() + 0.1 * torch.randn(4, 5, generator=gen)
    mask = torch.rand(4, 5, generator=gen) > 0.3
    adv = torch.randn(4, generator=gen)
    kw = dict(variant=variant, kl_beta=0.1, max_response_tokens=5, **CLIP)
    whole, _ = policy_loss(lp, old, ref, adv, mask, **kw)
    parts = [
        policy_loss(
            lp[s], old[s], ref[s], adv[s], mask[s], num_sequences=4, num_tokens=mask.sum(), **kw
        )[0]
        for s in (slice(0, 1), slice(1, 4))
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole)
    torch.testing.assert_close(grad_of(parts[0] + parts[1], lp), grad_of(whole, lp))


def test_bfloat16_logprobs_give_float32_loss_and_bf16_gradient():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), None, torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    assert loss.dtype == torch.float32
    assert grad_of(loss, lp).dtype == torch.bfloat16


def test_rejects_unknown_variant_and_bad_shapes():
    lp = leaf([[-1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="grpo.loss 'ppo': use one of grpo, dr_grpo"):
        policy_loss(lp, None, None, torch.ones(1), mask, variant="ppo")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, None, None, torch.ones(2), mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(lp, None, None, torch.ones(1), mask[:, :1])
