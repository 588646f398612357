"""The PPO math against plain loops written here, with masks and padding."""
import math

import pytest
import torch

from rlaif.algo import ppo


def _right_padded(batch=5, steps=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, steps + 1, (batch,), generator=g)
    mask = (torch.arange(steps)[None, :] < lengths[:, None]).float()
    return torch.randn(batch, steps, generator=g), torch.randn(batch, steps, generator=g), mask


def _gae_loop(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(values)
    for b in range(values.shape[0]):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 1.0), (0.99, 0.9), (0.5, 0.0)])
def test_gae_matches_loop(gamma, lam):
    rewards, values, mask = _right_padded()
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=1e-5)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_gae_keeps_float64_precision():
    """float64 input is computed in float64 (never demoted to float32): equal to the loop form to 1e-12."""
    rewards, values, mask = (t.double() for t in _right_padded(seed=5))
    adv, ret = ppo.gae(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = _gae_loop(rewards, values, mask, 0.99, 0.95)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, ref_adv, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ret, ref_ret, atol=1e-12, rtol=1e-12)


def test_gae_ignores_garbage_in_padding():
    rewards, values, mask = _right_padded(seed=3)
    noisy_r = torch.where(mask.bool(), rewards, torch.full_like(rewards, 1e6))
    noisy_v = torch.where(mask.bool(), values, torch.full_like(values, -1e6))
    torch.testing.assert_close(ppo.gae(noisy_r, noisy_v, mask, 1.0, 0.95)[0],
                               ppo.gae(rewards, values, mask, 1.0, 0.95)[0])


def test_masked_whiten_matches_manual():
    x, _, mask = _right_padded(batch=6, steps=7, seed=1)
    valid = x[mask.bool()]
    expected = (x - valid.mean()) / valid.std()
    out = ppo.masked_whiten(x, mask)
    torch.testing.assert_close(out[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=1e-4)
    assert torch.all(out[~mask.bool()] == 0)


def test_masked_whiten_across_ranks_equals_whole_batch():
    x, _, mask = _right_padded(batch=8, steps=6, seed=2)
    halves = [(x[:4], mask[:4]), (x[4:], mask[4:])]
    totals = sum(torch.stack([ppo.masked_sum(a, m), ppo.masked_sum(a * a, m), m.sum()]).double() for a, m in halves)
    parts = [ppo.masked_whiten(a, m, all_reduce=lambda _s: totals) for a, m in halves]
    torch.testing.assert_close(torch.cat(parts), ppo.masked_whiten(x, mask))


def test_kl_estimators():
    logp, ref, _ = _right_padded(seed=4)
    logp, ref = logp * 0.3, ref * 0.3
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            d = logp[b, t].item() - ref[b, t].item()
            assert math.isclose(ppo.kl_penalty(logp, ref, "k1")[b, t].item(), d, abs_tol=1e-6)
            assert math.isclose(ppo.kl_penalty(logp, ref, "k2")[b, t].item(), 0.5 * d * d, abs_tol=1e-6)
            assert math.isclose(ppo.kl_penalty(logp, ref, "k3")[b, t].item(), math.exp(-d) - 1 + d, abs_tol=1e-5)
    assert torch.all(ppo.kl_penalty(logp, ref, "k3") >= 0)
    with pytest.raises(ValueError):
        ppo.kl_penalty(logp, ref, "k4")


def test_token_rewards_put_score_on_last_real_token():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]).float()
    kl = torch.full((3, 5), 0.5)
    score = torch.tensor([1.0, 2.0, 3.0])
    r = ppo.token_rewards(score, kl, mask, kl_coef=0.1)
    for b, last in enumerate([2, 0, 4]):
        for t in range(5):
            expected = (-0.05 if mask[b, t] else 0.0) + (score[b].item() if t == last else 0.0)
            assert math.isclose(r[b, t].item(), expected, abs_tol=1e-6), (b, t)


def test_policy_loss_matches_loop():
    logp, old, mask = _right_padded(seed=5)
    logp, old = logp * 0.2, old * 0.2
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(9))
    loss, stats = ppo.policy_loss(logp, old, adv, mask, 0.2)
    total, n, clipped = 0.0, 0, 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t]:
                rho = math.exp(logp[b, t].item() - old[b, t].item())
                a = adv[b, t].item()
                total += -min(rho * a, min(max(rho, 0.8), 1.2) * a)
                clipped += min(max(rho, 0.8), 1.2) * a < rho * a
                n += 1
    assert math.isclose(loss.item(), total / n, rel_tol=1e-5)
    assert math.isclose(stats["clip_frac"], clipped / n, rel_tol=1e-5)


def test_value_loss_matches_loop():
    v, old, mask = _right_padded(seed=6)
    ret = torch.randn(v.shape, generator=torch.Generator().manual_seed(7))
    loss = ppo.value_loss(v, old, ret, mask, 0.2)
    total, n = 0.0, 0
    for b in range(v.shape[0]):
        for t in range(v.shape[1]):
            if mask[b, t]:
                vc = old[b, t].item() + min(max(v[b, t].item() - old[b, t].item(), -0.2), 0.2)
                total += 0.5 * max((v[b, t].item() - ret[b, t].item()) ** 2, (vc - ret[b, t].item()) ** 2)
                n += 1
    assert math.isclose(loss.item(), total / n, rel_tol=1e-5)


def test_adaptive_kl_controller_moves_toward_target():
    ctl = ppo.AdaptiveKLController(0.1, target=1.0, horizon=100)
    ctl.update(current_kl=3.0, n_steps=10)
    assert math.isclose(ctl.value, 0.1 * 1.02)
    ctl = ppo.AdaptiveKLController(0.1, target=1.0, horizon=100)
    ctl.update(current_kl=0.5, n_steps=10)
    assert math.isclose(ctl.value, 0.1 * (1 - 0.02))  # error -0.5 clipped to -0.2


def test_group_advantages_match_loop():
    torch.manual_seed(3)
    k, groups, steps = 4, 3, 5
    scores = torch.randn(groups * k)
    mask = (torch.rand(groups * k, steps) > 0.3).float()
    got = ppo.group_advantages(scores, k, mask)
    for g in range(groups):
        members = [scores[g * k + i].item() for i in range(k)]
        mean = sum(members) / k
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (k - 1))
        for i in range(k):
            row = g * k + i
            for t in range(steps):
                expected = (members[i] - mean) / (std + 1e-6) * mask[row, t].item()
                assert got[row, t].item() == pytest.approx(expected, abs=1e-5)
    # equal scores within a group carry no signal
    assert ppo.group_advantages(torch.ones(8), 4, torch.ones(8, 2)).abs().max() == 0


def test_split_minibatch_losses_sum_to_the_whole_minibatch_loss():
    """The normalizer makes micro-batch (and per-rank) losses add up to the token mean over the whole minibatch."""
    torch.manual_seed(4)
    b, t = 8, 6
    logp, old = torch.randn(b, t) * 0.1, torch.randn(b, t) * 0.1
    adv, mask = torch.randn(b, t), (torch.rand(b, t) > 0.4).float()
    mask[:, 0] = 1
    whole, _ = ppo.policy_loss(logp, old, adv, mask, 0.2)
    parts = [ppo.policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], 0.2,
                             normalizer=mask.sum().item())[0]
             for i in range(0, b, 2)]
    assert sum(parts).item() == pytest.approx(whole.item(), abs=1e-6)
    values, old_values, returns = torch.randn(b, t), torch.randn(b, t), torch.randn(b, t)
    whole_v = ppo.value_loss(values, old_values, returns, mask, 0.2)
    parts_v = [ppo.value_loss(values[i : i + 4], old_values[i : i + 4], returns[i : i + 4], mask[i : i + 4], 0.2,
                              normalizer=mask.sum().item()) for i in (0, 4)]
    assert sum(parts_v).item() == pytest.approx(whole_v.item(), abs=1e-6)


@pytest.mark.parametrize("steps,factor", [(1, 0.9), (63, 0.95), (64, 0.0), (200, 1.0), (1024, 0.5)])
def test_discounted_suffix_sum_matches_loop(steps, factor):
    torch.manual_seed(5)
    x = torch.randn(3, steps, dtype=torch.float64)
    expected = torch.zeros_like(x)
    running = torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(steps)):
        running = x[:, t] + factor * running
        expected[:, t] = running
    torch.testing.assert_close(ppo.discounted_suffix_sum(x, factor), expected, atol=1e-9, rtol=1e-9)


def test_bradley_terry_loss_matches_loop():
    from rlaif.algo.preference import bradley_terry_loss

    gen = torch.Generator().manual_seed(7)
    r_a, r_b, p = torch.randn(9, generator=gen), torch.randn(9, generator=gen), torch.rand(9, generator=gen)
    for margin in (0.0, 0.7):
        total = 0.0
        for i in range(9):
            z = r_a[i].item() - r_b[i].item() - margin * (2 * p[i].item() - 1)
            sig = 1 / (1 + math.exp(-z))
            total += -(p[i].item() * math.log(sig) + (1 - p[i].item()) * math.log(1 - sig))
        assert bradley_terry_loss(r_a, r_b, p, margin).item() == pytest.approx(total / 9, rel=1e-6)
    # Swapping the pair and the label leaves the loss unchanged; at p = 0.5 the margin has no effect
    torch.testing.assert_close(bradley_terry_loss(r_b, r_a, 1 - p, 0.7), bradley_terry_loss(r_a, r_b, p, 0.7))
    half = torch.full((9,), 0.5)
    torch.testing.assert_close(bradley_terry_loss(r_a, r_b, half, 3.0), bradley_terry_loss(r_a, r_b, half, 0.0))
