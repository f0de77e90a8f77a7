"""Tests for the pure math and the config layer of train_ppo.py.

Every expected number is worked out by hand from verl 0.9.1's definitions (docs/math.md)
and written as arithmetic; GAE is also checked against a naive scalar loop in the sum form
A_t = sum_k (gamma * lam)^(k - t) * delta_k. Nothing here imports verl.
Run from the repo root: python -m pytest tests/test_ppo_math.py -q
"""

import math
import statistics

import pytest
import torch

import core_algos
from config import load_config
from core_algos import (agg_loss, compute_gae, compute_grpo_advantages, compute_reinforce_pp_advantages,
                        compute_reinforce_pp_baseline_advantages, compute_rloo_advantages, entropy_from_logits,
                        explained_variance, kl_in_reward, masked_mean, masked_sum, masked_var, masked_whiten,
                        place_scores, policy_loss, value_loss)
from errors import UserError
from forward.batch import pack_batch

NAN = float("nan")
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def close(actual, expected, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(actual, t(expected), rtol=rtol, atol=atol)


def whiten_list(xs):
    """The spec's whitening of a plain list of numbers (unbiased variance)."""
    mean, std = statistics.fmean(xs), statistics.stdev(xs)
    return [(x - mean) / std for x in xs]


def valid(x, mask):
    """The valid entries of a [B, T] tensor, row by row, as a flat python list."""
    return x[mask.bool()].tolist()


# --------------------------------------------------------------------------------------------
# Masked helpers
# --------------------------------------------------------------------------------------------

def test_masked_sum_and_mean_ignore_nan_at_padded_positions():
    v = t([[1.0, 2.0, NAN], [4.0, NAN, NAN]])  # [2, 3]
    m = t([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(v, m).item() == 1 + 2 + 4
    assert masked_mean(v, m).item() == pytest.approx((1 + 2 + 4) / 3, rel=1e-8)
    close(masked_mean(v, m, dim=-1), [(1 + 2) / 2, 4 / 1])
    close(masked_sum(v, m, dim=-1), [3.0, 4.0])


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    # the 1e-8 sits in the denominator: 0 / (0 + 1e-8) = 0
    assert masked_mean(t([3.0, 5.0]), t([0, 0])).item() == 0.0


def test_masked_var_is_unbiased():
    v = t([[1.0, 2.0, 3.0, 4.0]])
    m = t([[1, 1, 1, 1]])
    # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5; unbiased: 5 / (4 - 1)
    assert masked_var(v, m).item() == pytest.approx(5 / 3, rel=1e-7)
    # padded values (even nan) are ignored: [1, 3] -> mean 2, (1 + 1) / (2 - 1)
    v2 = t([[1.0, 100.0], [3.0, NAN]])
    m2 = t([[1, 0], [1, 0]])
    assert masked_var(v2, m2).item() == pytest.approx(2.0, rel=1e-7)


def test_masked_whiten_gives_mean_0_var_1_on_valid_positions_and_shifts_padding():
    v = t([[1.0, 2.0, 9.0], [4.0, 5.0, 7.0]])
    m = t([[1, 1, 0], [1, 1, 1]])
    w = masked_whiten(v, m)
    assert masked_mean(w, m).item() == pytest.approx(0.0, abs=1e-7)
    assert masked_var(w, m).item() == pytest.approx(1.0, rel=1e-6)
    # valid [1, 2, 4, 5, 7]: mean 19/5 = 3.8; squared deviations 7.84 + 3.24 + 0.04 + 1.44 + 10.24
    # = 22.8, unbiased var 22.8 / 4 = 5.7
    assert w[0, 0].item() == pytest.approx((1 - 3.8) / math.sqrt(5.7), rel=1e-6)
    # verl quirk: a padded position is whitened with the same statistics, not zeroed
    assert w[0, 2].item() == pytest.approx((9 - 3.8) / math.sqrt(5.7), rel=1e-6)


def test_entropy_from_logits():
    logits = t([[[0.0, 0.0, 0.0, 0.0]], [[0.0, math.log(3.0), 0.0, 0.0]]])  # [2, 1, 4]
    h = entropy_from_logits(logits)
    assert h.shape == (2, 1)
    # uniform over 4: log 4. Second: p = [1, 3, 1, 1] / 6
    p = [1 / 6, 3 / 6, 1 / 6, 1 / 6]
    close(h, [[math.log(4)], [-sum(q * math.log(q) for q in p)]])


# --------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------

def naive_gae(rewards, values, gamma, lam):
    """One sequence's valid steps as lists; A_t = sum_{k >= t} (gamma lam)^(k-t) delta_k with
    delta_k = r_k + gamma V_{k+1} - V_k and V after the last step = 0."""
    n = len(rewards)
    adv = []
    for t_ in range(n):
        total = 0.0
        for k in range(t_, n):
            next_value = values[k + 1] if k + 1 < n else 0.0
            delta = rewards[k] + gamma * next_value - values[k]
            total += (gamma * lam) ** (k - t_) * delta
        adv.append(total)
    return adv


def test_gae_hand_worked_two_sequences():
    gamma, lam = 0.9, 0.8
    r = t([[0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    v = t([[0.5, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    m = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    # sequence 0, backwards:
    a2 = 1 + 0.9 * 0 - 0.5                      # 0.5
    a1 = (0 + 0.9 * 0.5 - 0.5) + 0.9 * 0.8 * a2  # -0.05 + 0.36 = 0.31
    a0 = (0 + 0.9 * 0.5 - 0.5) + 0.9 * 0.8 * a1  # -0.05 + 0.2232 = 0.1732
    # sequence 1: one step, delta = 2 - 1
    b0 = 2 - 1.0
    adv, ret = compute_gae(r, v, m, gamma, lam)
    # returns = unwhitened advantages + values; past the end the advantage is 0 so returns = V
    close(ret, [[a0 + 0.5, a1 + 0.5, a2 + 0.5, 0.0], [b0 + 1.0, 0.0, 0.0, 0.0]])
    raw = [a0, a1, a2, b0]
    mean, std = sum(raw) / 4, statistics.stdev(raw)
    close(adv[m.bool()], [(x - mean) / std for x in raw])
    # padded positions hold a raw 0, whitened with the batch statistics (not zeroed)
    close(adv[1, 1:], [(0 - mean) / std] * 3)


def test_gae_against_naive_loop_on_random_right_padded_data():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    gamma, lam = 0.97, 0.9
    lengths = [7, 1, 4, 6, 2, 5]
    m = t([[1.0] * n + [0.0] * (T - n) for n in lengths])
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = compute_gae(r, v, m, gamma, lam)
    raw = []
    for i, n in enumerate(lengths):
        expected = naive_gae(r[i, :n].tolist(), v[i, :n].tolist(), gamma, lam)
        close(ret[i, :n] - v[i, :n], expected, rtol=1e-9, atol=1e-10)
        raw += expected
    close(adv[m.bool()], whiten_list(raw), rtol=1e-6, atol=1e-7)


def test_gae_ignores_rewards_and_values_at_padded_positions():
    g = torch.Generator().manual_seed(1)
    B, T = 3, 5
    m = t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = compute_gae(r, v, m, 1.0, 0.95)
    pad = ~m.bool()
    r2, v2 = r.clone(), v.clone()
    r2[pad] = 1e3
    v2[pad] = -1e3
    adv2, ret2 = compute_gae(r2, v2, m, 1.0, 0.95)
    close(adv2[m.bool()], adv[m.bool()].tolist(), rtol=1e-12, atol=1e-12)
    close(ret2[m.bool()], ret[m.bool()].tolist(), rtol=1e-12, atol=1e-12)
    # and the garbage did change the padded returns (returns = adv + V there too), so the
    # equality above is not vacuous
    assert not torch.allclose(ret2[pad], ret[pad])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    r = t([[1.0, 2.0, 3.0]])
    v = t([[0.5, 1.0, 4.0]])
    m = t([[1, 1, 1]])
    _, ret = compute_gae(r, v, m, 1.0, 1.0)
    # lam = gamma = 1: A_t = sum_{k>=t} r_k - V_t, so returns = reward-to-go
    close(ret, [[1 + 2 + 3, 2 + 3, 3.0]])


# --------------------------------------------------------------------------------------------
# Critic-free estimators
# --------------------------------------------------------------------------------------------

# group 10: scores 1, 2, 3 (interleaved with the others); group 20: 5 alone; group 30: 4, 4
GROUP_IDS = torch.tensor([10, 30, 10, 20, 10, 30])
SCORE_TOKENS = t([
    [0.5, 0.5, 0.0],   # 1   (the score is the sum over tokens)
    [4.0, 0.0, 0.0],   # 4
    [0.0, 2.0, 0.0],   # 2
    [0.0, 0.0, 5.0],   # 5
    [1.0, 1.0, 1.0],   # 3
    [0.0, 4.0, 0.0],   # 4
])
SCORE_MASK = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])


def per_token(a, mask):
    return (t(a)[:, None] * mask).tolist()


def test_grpo_normalised_by_std():
    eps = 1e-6
    adv, ret = compute_grpo_advantages(SCORE_TOKENS, SCORE_MASK, GROUP_IDS, norm_by_std=True, eps=eps)
    # group 10: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1; group 20 alone: mean 0, std 1;
    # group 30: std 0, so (4 - 4) / (0 + eps) = 0
    a = [(1 - 2) / (1 + eps), 0.0, (2 - 2) / (1 + eps), (5 - 0) / (1 + eps), (3 - 2) / (1 + eps), 0.0]
    close(adv, per_token(a, SCORE_MASK))
    assert torch.equal(adv, ret)


def test_grpo_without_std_normalisation():
    adv, ret = compute_grpo_advantages(SCORE_TOKENS, SCORE_MASK, GROUP_IDS, norm_by_std=False)
    a = [1 - 2, 4 - 4, 2 - 2, 5 - 0, 3 - 2, 4 - 4]
    close(adv, per_token(a, SCORE_MASK))
    assert torch.equal(adv, ret)


def test_grpo_std_is_unbiased():
    # scores 0, 2: mean 1, unbiased std sqrt(2) (population std would be 1)
    r = t([[0.0], [2.0]])
    adv, _ = compute_grpo_advantages(r, t([[1], [1]]), torch.tensor([0, 0]), eps=0.0)
    close(adv, [[-1 / math.sqrt(2)], [1 / math.sqrt(2)]])


def test_rloo_leave_one_out():
    adv, ret = compute_rloo_advantages(SCORE_TOKENS, SCORE_MASK, GROUP_IDS)
    # each score minus the mean of the other scores of its group; a lone score stays as it is
    a = [1 - (2 + 3) / 2, 4 - 4, 2 - (1 + 3) / 2, 5.0, 3 - (1 + 2) / 2, 4 - 4]
    close(adv, per_token(a, SCORE_MASK))
    assert torch.equal(adv, ret)


def test_rloo_pair():
    adv, _ = compute_rloo_advantages(t([[4.0], [0.0]]), t([[1], [1]]), torch.tensor([7, 7]))
    close(adv, [[4.0 - 0.0], [0.0 - 4.0]])


def test_a_dropped_sample_is_no_part_of_its_groups_baseline():
    """skip_nonfinite_rewards: a group scored [1, 1, 1, NaN] trains as the group [1, 1, 1]: the NaN
    sample (its score zeroed, its mask cleared) changes no baseline."""
    scores = t([[1.0], [1.0], [1.0], [0.0]])            # the NaN, zeroed by the trainer
    mask = t([[1], [1], [1], [0]])
    valid = torch.tensor([True, True, True, False])
    groups = torch.tensor([3, 3, 3, 3])
    three = (t([[1.0], [1.0], [1.0]]), t([[1], [1], [1]]), groups[:3])
    adv, _ = compute_grpo_advantages(scores, mask, groups, valid=valid)
    close(adv, compute_grpo_advantages(*three)[0].tolist() + [[0.0]])
    close(adv, [[0.0]] * 4)                              # all three equal: no advantage
    adv, _ = compute_rloo_advantages(scores, mask, groups, valid)
    close(adv, [[0.0]] * 4)
    adv, _ = compute_reinforce_pp_baseline_advantages(scores, mask, groups, valid)
    close(adv, [[0.0]] * 4)
    # a NaN left in place is not read either
    nan_scores = t([[1.0], [2.0], [3.0], [float("nan")]])
    adv, _ = compute_grpo_advantages(nan_scores, mask, groups, norm_by_std=False, valid=valid)
    close(adv, [[-1.0], [0.0], [1.0], [0.0]])


def test_a_dropped_sample_gets_no_shaping_penalty():
    from config import Config
    from rewards.scoring import shape_scores
    cfg = Config(truncation_penalty=0.5, overlong_buffer_len=2, max_response_length=4, reward_clip=0.0)
    scores, responses = t([1.0, 0.0]), [[5, 6, 7, 8], []]
    truncated = torch.tensor([True, True])
    shaped = shape_scores(cfg, scores, responses, truncated, valid=torch.tensor([True, False]))
    assert shaped[1].item() == 0.0
    assert shaped[0].item() == pytest.approx(1.0 - 1.0 - 0.5)   # overlong at the max (-1) and truncated (-0.5)


def test_overlong_shaping_counts_tool_tokens_in_the_budget():
    """max_response_length is the whole trajectory's budget (model and tool tokens), as verl's DAPO
    reward manager measures the valid response length: 50 model + 48 tool + 2 model tokens use all
    of 100, so the penalty is full, though the model wrote only 52 of them."""
    from config import Config
    from rewards.scoring import shape_scores
    from rollout.tools.rollouts import ToolRolloutOutput
    cfg = Config(overlong_buffer_len=20, overlong_penalty_factor=1.0, max_response_length=100, reward_clip=0.0)
    tool_mask = torch.tensor([[1.0] * 50 + [0.0] * 48 + [1.0] * 2])                 # [1, 100]
    out = ToolRolloutOutput([[1, 2]], [list(range(3, 103))], None, tool_mask, torch.tensor([False]), {}, [], 0.0)
    assert out.batch(0)["response_mask"].sum().item() == 52                         # what the model wrote
    shaped = shape_scores(cfg, t([1.0]), out.responses, torch.tensor([False]))
    assert shaped.item() == pytest.approx(0.0)


def test_reinforce_pp_discounted_returns_and_whitening():
    r = t([[1.0, 0.0, 2.0], [0.0, 4.0, 7.0]])  # the 7 sits on a padded position
    m = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_pp_advantages(r, m, gamma=0.5)
    # sequence 0: 2; 0 + 0.5 * 2 = 1; 1 + 0.5 * 1 = 1.5.  sequence 1: 4; 0 + 0.5 * 4 = 2
    close(ret, [[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]])
    # valid returns [1.5, 1, 2, 2, 4]: mean 10.5 / 5 = 2.1; squared deviations
    # 0.36 + 1.21 + 0.01 + 0.01 + 3.61 = 5.2; unbiased var 5.2 / 4 = 1.3
    s = math.sqrt(1.3)
    close(adv, [[(1.5 - 2.1) / s, (1 - 2.1) / s, (2 - 2.1) / s], [(2 - 2.1) / s, (4 - 2.1) / s, 0.0]])


def test_reinforce_pp_baseline():
    # groups: 'a' scores 1 and 3 (mean 2), 'b' alone with 2 (baseline 0)
    r = t([[0.0, 1.0], [3.0, 0.0], [2.0, 0.0]])
    m = t([[1, 1], [1, 0], [1, 1]])
    adv, ret = compute_reinforce_pp_baseline_advantages(r, m, torch.tensor([0, 0, 1]))
    # x = [[-1, -1], [1, pad], [2, 2]]; valid [-1, -1, 1, 2, 2]: mean 3/5 = 0.6; squared deviations
    # 2.56 + 2.56 + 0.16 + 1.96 + 1.96 = 9.2; unbiased var 9.2 / 4 = 2.3
    s = math.sqrt(2.3)
    close(adv, [[(-1 - 0.6) / s, (-1 - 0.6) / s], [(1 - 0.6) / s, 0.0], [(2 - 0.6) / s, (2 - 0.6) / s]])
    assert torch.equal(adv, ret)


# --------------------------------------------------------------------------------------------
# agg_loss
# --------------------------------------------------------------------------------------------

# sequence 0: 3 tokens (1, 2, 3), sequence 1: 2 tokens (4, 5), sequence 2: empty. Padding holds 100s.
AGG_L = t([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0], [100.0, 100.0, 100.0, 100.0]])
AGG_M = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
AGG_HAND = {
    "token-mean": (1 + 2 + 3 + 4 + 5) / 5,
    "seq-mean-token-sum": ((1 + 2 + 3) + (4 + 5)) / 2,          # the empty sequence is not counted
    "seq-mean-token-mean": ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2,
    "seq-mean-token-sum-norm": ((1 + 2 + 3) + (4 + 5)) / 2 / 4,  # T = mask width = 4
}


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_hand_worked(mode):
    assert agg_loss(AGG_L, AGG_M, mode).item() == pytest.approx(AGG_HAND[mode], rel=1e-7)


def test_agg_loss_seq_len_overrides_width_for_sum_norm():
    out = agg_loss(AGG_L, AGG_M, "seq-mean-token-sum-norm", seq_len=10)
    assert out.item() == pytest.approx(((1 + 2 + 3) + (4 + 5)) / 2 / 10, rel=1e-7)


def test_agg_loss_unknown_mode_raises():
    with pytest.raises(ValueError, match="token-sum"):
        agg_loss(AGG_L, AGG_M, "token-sum")


def test_agg_loss_micro_batches_hand_worked():
    # split after sequence 0; whole-batch denominators: 5 tokens, 2 non-empty sequences
    first = agg_loss(AGG_L[:1], AGG_M[:1], "token-mean", num_tokens=5)
    second = agg_loss(AGG_L[1:], AGG_M[1:], "token-mean", num_tokens=5)
    assert first.item() == pytest.approx((1 + 2 + 3) / 5)
    assert second.item() == pytest.approx((4 + 5) / 5)
    first = agg_loss(AGG_L[:1], AGG_M[:1], "seq-mean-token-mean", num_seqs=2)
    assert first.item() == pytest.approx((1 + 2 + 3) / 3 / 2, rel=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_micro_batch_pieces_sum_to_whole(mode):
    g = torch.Generator().manual_seed(2)
    B, T = 7, 6
    lengths = [6, 1, 0, 3, 5, 2, 4]
    m = t([[1.0] * n + [0.0] * (T - n) for n in lengths])
    L = torch.randn(B, T, generator=g, dtype=torch.float64)
    whole = agg_loss(L, m, mode)
    norms = {"num_tokens": m.sum(), "num_seqs": (m.sum(-1) > 0).sum().to(m.dtype), "seq_len": T}
    pieces = [agg_loss(L[s], m[s], mode, **norms) for s in (slice(0, 2), slice(2, 5), slice(5, 7))]
    assert sum(p.item() for p in pieces) == pytest.approx(whole.item(), rel=1e-9)
    # without the whole-batch denominators the pieces are means of unequal parts and do not sum up
    local = [agg_loss(L[s], m[s], mode) for s in (slice(0, 2), slice(2, 5), slice(5, 7))]
    assert sum(p.item() for p in local) != pytest.approx(whole.item(), rel=1e-3)


def test_policy_loss_micro_batch_pieces_sum_to_whole():
    g = torch.Generator().manual_seed(3)
    m = t([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    old = -torch.rand(4, 4, generator=g, dtype=torch.float64)
    new = old + 0.3 * torch.randn(4, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 4, generator=g, dtype=torch.float64)
    for mode in MODES:
        whole, _ = policy_loss(old, new, adv, m, 0.2, 0.2, 3.0, mode)
        norms = {"num_tokens": m.sum(), "num_seqs": t(4.0), "seq_len": 4}
        a, _ = policy_loss(old[:1], new[:1], adv[:1], m[:1], 0.2, 0.2, 3.0, mode, **norms)
        b, _ = policy_loss(old[1:], new[1:], adv[1:], m[1:], 0.2, 0.2, 3.0, mode, **norms)
        assert (a + b).item() == pytest.approx(whole.item(), rel=1e-9), mode


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------

def run_policy(ratios, advantages, low, high, c=3.0, mask=None):
    """old_logprob = 0 and logprob = log(ratio), so exp(logprob - old) is the ratio."""
    ratios = t([ratios])
    logprob = ratios.log().requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else t([mask])
    loss, stats = policy_loss(torch.zeros_like(ratios), logprob, t([advantages]), mask, low, high, c, "token-mean")
    return loss, stats, logprob


def test_exp_log_roundtrip_is_exact_for_the_ratios_used():
    # a precondition for the "exactly at the bound" tests below
    for x in (0.5, 0.75, 1.25, 1.5, 1.75, 2.0):
        assert torch.exp(torch.log(t(x))).item() == x


def test_ratio_exactly_at_the_bounds_is_not_counted_as_clipped():
    # low = 0.25, high = 0.5: ratio 0.75 = 1 - low and 1.5 = 1 + high, with A of either sign
    loss, stats, _ = run_policy([0.75, 1.5, 0.75, 1.5], [1.0, 1.0, -1.0, -1.0], 0.25, 0.5)
    assert stats["pg_clipfrac"].item() == 0.0
    assert stats["pg_clipfrac_lower"].item() == 0.0
    assert loss.item() == pytest.approx((-0.75 - 1.5 + 0.75 + 1.5) / 4, abs=1e-12)
    # a ratio just past a bound is clipped (and counted)
    _, stats, _ = run_policy([1.5 + 1e-9, 0.75 - 1e-9], [1.0, -1.0], 0.25, 0.5)
    assert stats["pg_clipfrac"].item() == pytest.approx(1.0)


def test_asymmetric_clip_ratio_low_and_high():
    ratios, adv = [1.25, 1.75, 0.5, 0.75], [1.0, 1.0, -1.0, -1.0]
    # low = 0.25 -> [0.75, 1.5]: 1.25 kept, 1.75 clipped to 1.5, 0.5 clipped up to 0.75 (A < 0: the
    # larger loss wins), 0.75 at the bound
    loss, stats, _ = run_policy(ratios, adv, 0.25, 0.5)
    assert loss.item() == pytest.approx((-1.25 - 1.5 + 0.75 + 0.75) / 4)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 4)
    # swapped, low = 0.5, high = 0.25 -> [0.5, 1.25]: 1.25 at the bound, 1.75 clipped to 1.25,
    # 0.5 at the bound, 0.75 inside
    loss, stats, _ = run_policy(ratios, adv, 0.5, 0.25)
    assert loss.item() == pytest.approx((-1.25 - 1.25 + 0.5 + 0.75) / 4)
    assert stats["pg_clipfrac"].item() == pytest.approx(1 / 4)


def test_dual_clip_caps_the_loss_for_negative_advantage():
    # A = -2, ratio 10 (log-ratio log 10), c = 3: l1 = 20, l2 = 2 * 1.2 = 2.4, max = 20; capped at
    # -A * c = 6
    loss, stats, logprob = run_policy([10.0], [-2.0], 0.2, 0.2, c=3.0)
    assert loss.item() == pytest.approx(2.0 * 3.0)
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(1.0)
    assert stats["pg_clipfrac"].item() == 0.0     # l2 (2.4) is not > l1 (20)
    loss.backward()
    assert logprob.grad.item() == 0.0


def test_dual_clip_does_not_touch_a_negative_advantage_below_c():
    # A = -1, ratio 2 < c = 3: l1 = 2 > l2 = 1.2 and < l3 = 3, the loss is -A * ratio
    loss, stats, logprob = run_policy([2.0], [-1.0], 0.2, 0.2, c=3.0)
    assert loss.item() == pytest.approx(2.0)
    assert stats["pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    assert logprob.grad.item() == pytest.approx(2.0)   # d(-A * exp(logprob)) / d logprob = ratio


def test_positive_advantage_large_ratio_is_clipped_not_dual_clipped():
    # A = 1, ratio 10: l1 = -10, l2 = -1.2, the max is -1.2; the dual clip applies only to A < 0
    loss, stats, logprob = run_policy([10.0], [1.0], 0.2, 0.2, c=3.0)
    assert loss.item() == pytest.approx(-1.2)
    assert stats["pg_clipfrac"].item() == pytest.approx(1.0)
    assert stats["pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    assert logprob.grad.item() == 0.0


def test_ppo_kl_is_masked_mean_of_minus_log_ratio():
    old = t([[-1.0, -2.0, -3.0]])
    new = t([[-0.9, -2.3, 50.0]])  # the third token is padding
    m = t([[1, 1, 0]])
    _, stats = policy_loss(old, new, t([[1.0, 1.0, 1.0]]), m, 0.2, 0.2, 3.0, "token-mean")
    assert stats["ppo_kl"].item() == pytest.approx((-0.1 + 0.3) / 2, rel=1e-7)


def test_gradient_is_zero_where_clipped_and_masked():
    # tokens: inside (ratio 1, A = 1), clipped high (ratio 2, A = 1), clipped low (ratio 0.5, A = -1),
    # dual-clipped (ratio 4, A = -1, c = 3: l1 = 4 > l3 = 3), padding
    ratios = [1.0, 2.0, 0.5, 4.0, 1.0]
    loss, stats, logprob = run_policy(ratios, [1.0, 1.0, -1.0, -1.0, 1.0], 0.2, 0.2, c=3.0,
                                      mask=[1, 1, 1, 1, 0])
    # losses: -1, -1.2, 0.8, 3 over 4 valid tokens
    assert loss.item() == pytest.approx((-1 - 1.2 + 0.8 + 3) / 4)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    loss.backward()
    # only the unclipped token has a gradient: -A * ratio / 4 tokens
    close(logprob.grad, [[-1.0 / 4, 0.0, 0.0, 0.0, 0.0]], rtol=1e-12, atol=1e-12)


def test_log_ratio_is_clamped_at_20():
    # A < 0 and log-ratio 1000: exp would overflow; clamped to exp(20), then dual-clipped to -A * c
    old, new = t([[0.0]]), t([[1000.0]])
    loss, stats = policy_loss(old, new, t([[-1.0]]), t([[1]]), 0.2, 0.2, 3.0, "token-mean")
    assert loss.item() == pytest.approx(3.0)
    assert stats["ppo_kl"].item() == pytest.approx(-20.0)


# --------------------------------------------------------------------------------------------
# Value loss and explained variance
# --------------------------------------------------------------------------------------------

def test_value_loss_clipping_clipfrac_and_half_factor():
    values = t([[0.0, 0.0, 0.0, 0.0, 0.0]])     # old values
    returns = t([[1.0, 1.0, 2.0, 1.0, 9.0]])
    vpreds = t([[2.0, 0.3, 1.8, 0.5, -9.0]])    # last token is padding
    m = t([[1, 1, 1, 1, 0]])
    loss, clipfrac = value_loss(vpreds, returns, values, m, 0.5, "token-mean")
    # token 0: vclip 0.5, (2-1)^2 = 1 vs (0.5-1)^2 = 0.25 -> 1, not counted
    # token 1: inside, 0.49 both, not counted
    # token 2: vclip 0.5, (1.8-2)^2 = 0.04 vs (0.5-2)^2 = 2.25 -> 2.25, counted
    # token 3: exactly at the bound, 0.25 both, not counted
    assert loss.item() == pytest.approx(0.5 * (1 + 0.49 + 2.25 + 0.25) / 4)
    assert clipfrac.item() == pytest.approx(1 / 4)


def test_value_loss_gradient_flows_only_where_unclipped_term_wins():
    values, returns = t([[0.0, 0.0]]), t([[2.0, 1.0]])
    vpreds = t([[1.8, 0.3]]).requires_grad_(True)
    loss, _ = value_loss(vpreds, returns, values, t([[1, 1]]), 0.5, "token-mean")
    loss.backward()
    # token 0: the clipped term (constant in vpred) wins -> 0; token 1: 0.5 * 2 (0.3 - 1) / 2 tokens
    close(vpreds.grad, [[0.0, 0.5 * 2 * (0.3 - 1.0) / 2]], rtol=1e-12, atol=1e-12)


def test_explained_variance():
    returns = t([[1.0, 2.0, 3.0, 50.0]])
    values = t([[0.5, 2.0, 3.5, -50.0]])   # last token is padding
    m = t([[1, 1, 1, 0]])
    # R - V = [0.5, 0, -0.5]: unbiased var 0.5 / 2 = 0.25; var(R) = 2 / 2 = 1
    assert explained_variance(returns, values, m).item() == pytest.approx(1 - 0.25 / (1 + 1e-5), rel=1e-7)


# --------------------------------------------------------------------------------------------
# KL in the reward
# --------------------------------------------------------------------------------------------

def test_kl_in_reward_k1_two_sequences_of_different_lengths():
    ref = t([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]])
    old = ref + t([[0.3, 0.1, 0.2, 9.0], [0.6, 9.0, 9.0, 9.0]])  # 9s on padding
    m = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    scores = t([[0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    rewards, current_kl = kl_in_reward(scores, old, ref, m, 0.5, "kl")
    close(rewards, [[-0.5 * 0.3, -0.5 * 0.1, 1 - 0.5 * 0.2, 0.0], [2 - 0.5 * 0.6, 0.0, 0.0, 0.0]])
    # mean over sequences of each sequence's mean: ((0.3 + 0.1 + 0.2) / 3 + 0.6) / 2 = 0.4
    # (a token mean would give 1.2 / 4 = 0.3)
    assert current_kl.item() == pytest.approx(((0.3 + 0.1 + 0.2) / 3 + 0.6) / 2, rel=1e-7)


def test_kl_in_reward_uses_the_named_estimator():
    ref = t([[0.0, 0.0]])
    old = t([[-0.6, 0.2]])
    m = t([[1, 1]])
    rewards, current_kl = kl_in_reward(t([[0.0, 1.0]]), old, ref, m, 2.0, "k2")
    # k2 = 0.5 d^2: 0.18 and 0.02
    close(rewards, [[-2 * 0.18, 1 - 2 * 0.02]])
    assert current_kl.item() == pytest.approx((0.18 + 0.02) / 2, rel=1e-7)


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------

def test_pack_batch_left_pads_prompts_right_pads_responses():
    b = pack_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # positions count real tokens from 0; left padding sits at 0, right padding repeats the last
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b["responses"].tolist() == [[1, 2, 0], [3, 4, 9]]
    assert b["response_mask"].tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    assert b["response_mask"].is_floating_point()


def test_pack_batch_empty_response_keeps_one_masked_column():
    b = pack_batch([[5], [6, 7]], [[], []], pad_id=2)
    assert b["input_ids"].tolist() == [[2, 5, 2], [6, 7, 2]]
    assert b["response_mask"].tolist() == [[0.0], [0.0]]


PLACE_MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0]]   # responses of 2, 3 and 1 tokens


def test_place_scores_on_last_real_response_token():
    out = place_scores(t([2.5, -1.0, 0.25]), t(PLACE_MASK), "last", 0.9)
    assert out.tolist() == [[0.0, 2.5, 0.0], [0.0, 0.0, -1.0], [0.25, 0.0, 0.0]]



def test_place_scores_last_is_the_last_token_of_mask_one_when_the_mask_has_gaps():
    # multi-turn: tool tokens (mask 0) sit between and after the policy's tokens
    out = place_scores(t([2.0, -1.0]), t([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]), "last", 0.9)
    close(out, t([[0, 0, 0, 0, 2.0, 0], [-1.0, 0, 0, 0, 0, 0]]))

def test_place_scores_uniform_spreads_score_over_length():
    out = place_scores(t([2.5, -1.0, 0.25]), t(PLACE_MASK), "uniform", 0.9)
    close(out, [[1.25, 1.25, 0.0], [-1 / 3, -1 / 3, -1 / 3], [0.25, 0.0, 0.0]])


def test_place_scores_decay_halves_back_from_the_last_token_and_keeps_the_total():
    out = place_scores(t([2.5, -1.0, 0.25]), t(PLACE_MASK), "decay", 0.5)
    # L=2: weights 0.5, 1 over 1.5; L=3: 0.25, 0.5, 1 over 1.75; L=1: all on the one token
    close(out, [[2.5 * 0.5 / 1.5, 2.5 * 1 / 1.5, 0.0], [-0.25 / 1.75, -0.5 / 1.75, -1 / 1.75], [0.25, 0.0, 0.0]])
    close(out.sum(-1), [2.5, -1.0, 0.25])
    # decay 1 is uniform; a tiny decay is (nearly) last
    close(place_scores(t([2.5, -1.0, 0.25]), t(PLACE_MASK), "decay", 1.0),
          place_scores(t([2.5, -1.0, 0.25]), t(PLACE_MASK), "uniform", 0.9).tolist())
    close(place_scores(t([2.5, -1.0, 0.25]), t(PLACE_MASK), "decay", 1e-9),
          place_scores(t([2.5, -1.0, 0.25]), t(PLACE_MASK), "last", 0.9).tolist(), atol=1e-8)


def test_every_placement_gives_grpo_the_same_advantages():
    """Placements keep each sequence's total, and GRPO compares totals: only GAE-style credit moves."""
    mask, scores = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]), t([1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    ref, _ = compute_grpo_advantages(place_scores(scores, mask, "last", 0.9), mask, groups)
    for placement in ("uniform", "decay"):
        adv, _ = compute_grpo_advantages(place_scores(scores, mask, placement, 0.5), mask, groups)
        torch.testing.assert_close(adv, ref)


def test_place_scores_decay_counts_real_tokens_only_and_leaves_empty_rows_zero():
    # a masked-out token in the middle (e.g. a tool's output) takes no share and no decay step
    out = place_scores(t([3.0, 7.0]), t([[1, 0, 1], [0, 0, 0]]), "decay", 0.5)
    close(out, [[3.0 * 0.5 / 1.5, 0.0, 3.0 * 1 / 1.5], [0.0, 0.0, 0.0]])
    close(place_scores(t([3.0, 7.0]), t([[1, 0, 1], [0, 0, 0]]), "uniform", 0.5), [[1.5, 0.0, 1.5], [0.0, 0.0, 0.0]])


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    import pandas as pd
    root = tmp_path_factory.mktemp("cfg")
    (root / "model").mkdir()
    for name in ("train", "val"):
        pd.DataFrame({"prompt": ["1+1=", "2+2="]}).to_parquet(root / f"{name}.parquet")
    return root


@pytest.fixture
def base(paths):
    return ["--model_path", str(paths / "model"), f"--train_files={paths / 'train.parquet'}",
            f"--val_files={paths / 'val.parquet'}"]


def write_yaml(path, text):
    path.write_text(text)
    return str(path)


def error_of(argv):
    with pytest.raises(UserError) as e:
        load_config(argv)
    return str(e.value)


def test_config_valid_base(base, paths):
    cfg = load_config(base)
    assert cfg.model_path == str(paths / "model")
    assert cfg.train_files == str(paths / "train.parquet")


def test_config_unknown_key_names_it_and_the_closest(base):
    msg = error_of(base + ["--clip_ratoi=0.3"])
    assert "clip_ratoi" in msg and "clip_ratio" in msg.replace("clip_ratoi", "")


def test_config_unknown_key_in_yaml(base, tmp_path):
    msg = error_of(base + ["--config", write_yaml(tmp_path / "a.yaml", "ppo_epoch: 3\n")])
    assert "ppo_epoch" in msg and "ppo_epochs" in msg


@pytest.mark.parametrize("arg,key", [
    ("--ppo_epochs=two", "ppo_epochs"),
    ("--ppo_epochs=1.5", "ppo_epochs"),
    ("--actor_lr=fast", "actor_lr"),
    ("--use_kl_loss=maybe", "use_kl_loss"),
])
def test_config_wrong_type(base, arg, key):
    assert key in error_of(base + [arg])


def test_config_wrong_type_in_yaml(base, tmp_path):
    assert "ppo_epochs" in error_of(base + ["--config", write_yaml(tmp_path / "a.yaml", "ppo_epochs: 1.5\n")])
    assert "gamma" in error_of(base + ["--config", write_yaml(tmp_path / "b.yaml", "gamma: true\n")])


@pytest.mark.parametrize("value", ["1.0", "0.5"])
def test_config_clip_ratio_c_must_exceed_1(base, value):
    assert "clip_ratio_c" in error_of(base + [f"--clip_ratio_c={value}"])


@pytest.mark.parametrize("arg,key", [
    ("--reward_placement=first", "reward_placement"),
    ("--reward_placement=decay --reward_decay=0", "reward_decay"),
    ("--reward_decay=1.5", "reward_decay"),
    ("--filter_groups_metric=reward", "filter_groups_metric"),
    ("--max_num_gen_batches=-1", "max_num_gen_batches"),
    ("--filter_groups_enable=true --rollout_n=1", "rollout_n"),
    ("--filter_groups_enable=true --filter_groups_metric=seq_final_reward --use_kl_in_reward=true", "seq_final_reward"),
    ("--filter_groups_enable=true --rollout_n=2 --tools=rollout.tools.builtin:calculator", "tools/environment"),
])
def test_config_reward_placement_and_filter_groups_are_checked(base, arg, key):
    assert key in error_of(base + arg.split())


def test_config_seq_final_reward_without_kl_in_reward_is_accepted(base):
    cfg = load_config(base + ["--filter_groups_enable=true", "--filter_groups_metric=seq_final_reward",
                              "--use_kl_in_reward=false", "--adv_estimator=grpo"])
    assert cfg.filter_groups_metric == "seq_final_reward"


def test_config_clip_ratio_c_just_above_1_is_accepted(base):
    assert load_config(base + ["--clip_ratio_c=1.01"]).clip_ratio_c == 1.01


@pytest.mark.parametrize("value", ["0", "-0.1"])
def test_config_target_kl_must_be_positive_with_adaptive_kl_in_reward(base, value):
    msg = error_of(base + ["--kl_ctrl_type=adaptive", "--use_kl_in_reward=true", f"--target_kl={value}"])
    assert "target_kl" in msg


def test_config_target_kl_is_not_checked_when_unused(base):
    assert load_config(base + ["--kl_ctrl_type=adaptive", "--use_kl_in_reward=false", "--target_kl=0"]).target_kl == 0
    assert load_config(base + ["--kl_ctrl_type=fixed", "--target_kl=0"]).target_kl == 0


def test_config_train_batch_size_multiple_of_mini_batch(base):
    msg = error_of(base + ["--train_batch_size=10", "--ppo_mini_batch_size=4"])
    assert "train_batch_size" in msg and "ppo_mini_batch_size" in msg
    assert load_config(base + ["--train_batch_size=12", "--ppo_mini_batch_size=4"]).train_batch_size == 12


@pytest.mark.parametrize("key", ["model_path", "critic_model_path", "ref_model_path", "reward_model_path"])
def test_config_missing_model_dir(base, paths, key):
    msg = error_of(base + [f"--{key}={paths / 'nope'}"])
    assert key in msg and "nope" in msg


@pytest.mark.parametrize("key", ["train_files", "val_files"])
def test_config_missing_data_file(base, paths, key):
    msg = error_of(base + [f"--{key}={paths / 'train.parquet'},{paths / 'missing.parquet'}"])
    assert key in msg and "missing.parquet" in msg


def test_config_missing_yaml_file(base, paths):
    assert "absent.yaml" in error_of(base + ["--config", str(paths / "absent.yaml")])


@pytest.mark.parametrize("key,value", [
    ("adv_estimator", "ppo"),
    ("loss_agg_mode", "token-sum"),
    ("kl_penalty", "k4"),
    ("kl_loss_type", "exact"),
    ("kl_ctrl_type", "pid"),
])
def test_config_unknown_names(base, key, value):
    msg = error_of(base + [f"--{key}={value}"])
    assert key in msg and value in msg


def test_config_key_value_and_key_equals_value_agree(base):
    a = load_config(base + ["--gamma", "0.9", "--adv_estimator", "grpo", "--ppo_epochs", "3"])
    b = load_config(base + ["--gamma=0.9", "--adv_estimator=grpo", "--ppo_epochs=3"])
    assert (a.gamma, a.adv_estimator, a.ppo_epochs) == (0.9, "grpo", 3)
    assert a == b


def test_config_flag_without_value_is_an_error(base):
    assert "use_kl_loss" in error_of(base + ["--use_kl_loss"])


def test_config_yaml_then_cli_precedence(base, tmp_path):
    first = write_yaml(tmp_path / "first.yaml", "ppo_epochs: 3\ngamma: 0.9\nlam: 0.5\n")
    second = write_yaml(tmp_path / "second.yaml", "lam: 0.7\n")
    cfg = load_config(base + ["--config", first, "--ppo_epochs=1"])
    assert (cfg.ppo_epochs, cfg.gamma) == (1, 0.9)
    # the CLI wins even when written before --config
    cfg = load_config(base + ["--ppo_epochs=1", "--config", first])
    assert (cfg.ppo_epochs, cfg.gamma) == (1, 0.9)
    # of two files, the later wins
    assert load_config(base + ["--config", first, "--config", second]).lam == 0.7
    assert load_config(base + ["--config", second, "--config", first]).lam == 0.5


@pytest.mark.parametrize("text,expected", [("true", True), ("false", False), ("True", True), ("False", False)])
def test_config_booleans_from_cli(base, text, expected):
    cfg = load_config(base + [f"--use_kl_loss={text}", "--val_before_train", text])
    assert cfg.use_kl_loss is expected and cfg.val_before_train is expected


def test_config_booleans_from_yaml(base, tmp_path):
    path = write_yaml(tmp_path / "b.yaml", "use_kl_loss: true\nval_before_train: false\n")
    cfg = load_config(base + ["--config", path])
    assert cfg.use_kl_loss is True and cfg.val_before_train is False


def test_config_optional_clip_ratio_low(base):
    assert load_config(base + ["--clip_ratio_low=0.1"]).clip_ratio_low == 0.1
    assert load_config(base + ["--clip_ratio_low=none"]).clip_ratio_low is None


def test_config_positional_argument_is_an_error(base):
    assert "stray" in error_of(base + ["stray"])


def test_loss_agg_modes_constant_is_the_documented_set():
    assert set(core_algos.LOSS_AGG_MODES) == set(MODES)


# --- reward shaping, learning-rate schedule, token-budget micro-batches -------------------------
def test_overlong_penalty_is_zero_until_the_buffer_then_linear():
    from core_algos import overlong_penalty
    lengths = torch.tensor([10.0, 12.0, 14.0, 16.0])
    # max 16, buffer 4 -> expected 12: 10 and 12 free, 14 is half-way, 16 gets the whole factor
    got = overlong_penalty(lengths, 16, 4, 2.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -(14 - 12) / 4 * 2.0, -(16 - 12) / 4 * 2.0])


def test_lr_factor_warmup_constant_and_cosine():
    from core_algos import lr_factor
    assert [lr_factor(s, 4, 20, "constant", 0.0) for s in (0, 2, 4, 19)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    # cosine from the end of warmup (step 4) to the last step (20): half-way is the midpoint
    assert lr_factor(4, 4, 20, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(12, 4, 20, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(20, 4, 20, "cosine", 0.1) == pytest.approx(0.1)


def test_token_budget_splits_respect_the_budget_and_cover_every_sequence_once():
    from forward.batch import token_budget_splits
    lengths = [3, 3, 3, 5, 9, 1]
    groups = token_budget_splits(lengths, 6)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:   # within budget, unless a sequence alone is longer
        assert sum(lengths[i] for i in g) <= 6 or len(g) == 1
        assert g == sorted(g)
    assert len(groups) == 4   # first-fit decreasing: {9} {5, 1} {3, 3} {3}
    assert token_budget_splits([2, 2, 2], 100) == [[0, 1, 2]]


def test_token_budget_splits_into_an_agreed_count_stay_within_the_budget():
    """Another rank needed more micro-batches: this one splits into exactly that many."""
    from forward.batch import token_budget_splits
    lengths = [4, 4, 4, 4, 2, 2]
    assert len(token_budget_splits(lengths, 100)) == 1
    for count in range(1, len(lengths) + 1):
        groups = token_budget_splits(lengths, 100, count)
        assert len(groups) == count and all(groups)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    groups = token_budget_splits(lengths, 8, 5)
    assert len(groups) == 5 and all(sum(lengths[i] for i in g) <= 8 for g in groups)
    with pytest.raises(ValueError):
        token_budget_splits(lengths, 100, len(lengths) + 1)


def test_micro_batches_are_trimmed_to_their_own_longest_sequence():
    """The token budget bounds what is computed: no column that every row of a micro-batch pads."""
    from forward.batch import micro_batches, pack_batch
    prompts = [[5] * 2, [5] * 9, [6] * 3, [7] * 1]
    responses = [[1] * 2, [1] * 6, [2] * 1, [3] * 3]
    batch = pack_batch(prompts, responses, pad_id=0)                              # width 9 + 6
    for idx, mb in micro_batches(batch, 0, max_tokens=7):
        rows = idx.tolist()
        longest_prompt = max(len(prompts[i]) for i in rows)
        longest_response = max(len(responses[i]) for i in rows)
        assert mb["input_ids"].shape[1] == longest_prompt + longest_response
        assert mb["responses"].shape[1] == mb["response_mask"].shape[1] == longest_response
        assert int(mb["attention_mask"].sum()) == sum(len(prompts[i]) + len(responses[i]) for i in rows)
        assert int(mb["attention_mask"].sum()) <= 7 or len(rows) == 1
        for j, i in enumerate(rows):   # the real tokens survive, in place
            assert mb["input_ids"][j][mb["attention_mask"][j].bool()].tolist() == prompts[i] + responses[i]


def test_forward_in_micro_batches_puts_rows_back_in_batch_order():
    from forward.batch import forward_in_micro_batches, pack_batch
    prompts = [[5] * 4, [5], [6] * 2, [7] * 3, [8]]
    responses = [[1] * 3, [1], [2] * 2, [3] * 4, [4] * 2]
    batch = pack_batch(prompts, responses, pad_id=0)
    row_sums = lambda mb: mb["input_ids"].sum(-1).float()                         # noqa: E731
    first_token = lambda mb: mb["responses"].float()                              # noqa: E731
    for kwargs in ({"size": 2}, {"size": 0, "max_tokens": 6}, {"size": 0, "max_tokens": 6, "agree": lambda k: 5}):
        assert forward_in_micro_batches(row_sums, batch, **kwargs).tolist() == [sum(p + r) for p, r in
                                                                                 zip(prompts, responses)]
        got = forward_in_micro_batches(first_token, batch, **kwargs)
        assert got.shape == batch["responses"].shape
        assert (got == batch["responses"].float() * batch["response_mask"]).all()


def test_validation_shares_are_equal_on_every_rank_and_count_each_prompt_once():
    from train_ppo import validation_share
    for n in (1, 2, 3, 7):
        for world in (1, 2, 3, 4):
            shares = [validation_share(n, world, rank) for rank in range(world)]
            assert len({len(idx) for idx, _ in shares}) == 1                    # same number of passes
            counted = [i for idx, real in shares for i in idx[:real]]
            assert sorted(counted) == list(range(n))


def test_micro_batches_by_token_budget_sum_to_the_mini_batch_loss():
    from core_algos import agg_loss
    from forward.batch import micro_batches, pack_batch
    batch = pack_batch([[5, 6], [5], [7, 8, 9], [4]], [[1, 2, 3], [1], [2, 2], [3, 3, 3]], pad_id=0)
    loss_mat = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    batch["loss"] = loss_mat
    whole = agg_loss(loss_mat, batch["response_mask"], "token-mean")
    norms = {"num_tokens": batch["response_mask"].sum()}
    pieces = [agg_loss(mb["loss"], mb["response_mask"], "token-mean", **norms) for _, mb in micro_batches(batch, 0, 6)]
    assert len(pieces) > 1
    assert sum(pieces) == pytest.approx(whole.item())


# --- rollout correction: truncated importance sampling of the sampler ---------------------------
def test_rollout_is_weights_token_and_sequence_hand_worked():
    from core_algos import rollout_is_weights
    old = t([[0.0, -1.0, -2.0], [-0.5, -0.5, 0.0]])
    sampler = t([[-0.5, -1.0, -1.0], [0.0, -2.0, 5.0]])      # the last token of row 1 is padding
    mask = t([[1, 1, 1], [1, 1, 0]])
    w, stats = rollout_is_weights(old, sampler, mask, "token", 2.0)
    # exp(0.5) = 1.65, exp(0) = 1, exp(-1) = 0.37; exp(-0.5) = 0.61, exp(1.5) = 4.48 -> capped at 2
    close(w, [[math.exp(0.5), 1.0, math.exp(-1.0)], [math.exp(-0.5), 2.0, 0.0]])
    assert stats["clipped_frac"].item() == pytest.approx(1 / 5)
    assert stats["weight_max"].item() == pytest.approx(2.0)
    assert stats["weight_mean"].item() == pytest.approx((math.exp(0.5) + 1 + math.exp(-1) + math.exp(-0.5) + 2) / 5)
    w, stats = rollout_is_weights(old, sampler, mask, "sequence", 2.0)
    # row 0: exp(0.5 + 0 - 1) = exp(-0.5); row 1: exp(-0.5 + 1.5) = e > 2 -> 2 on every token
    close(w, [[math.exp(-0.5)] * 3, [2.0, 2.0, 0.0]])
    assert stats["clipped_frac"].item() == pytest.approx(2 / 5)


def test_rollout_is_weights_scale_the_policy_loss_per_token():
    """A mismatched sampler: each token's surrogate is multiplied by its weight, so a uniform
    weight scales the loss and its gradient; weights of 1 change nothing."""
    old = t([[-1.0, -0.5, -2.0]])
    logprob = t([[-0.9, -0.6, -1.5]]).requires_grad_()
    adv, mask = t([[1.0, -2.0, 0.5]]), t([[1, 1, 1]])
    args = (old, logprob, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    base, _ = policy_loss(*args)
    ones, _ = policy_loss(*args, is_weights=torch.ones(1, 3))
    half, _ = policy_loss(*args, is_weights=torch.full((1, 3), 0.5))
    assert ones.item() == pytest.approx(base.item())
    assert half.item() == pytest.approx(0.5 * base.item())
    w = t([[2.0, 0.0, 1.0]])
    weighted, _ = policy_loss(*args, is_weights=w)
    (g_w,) = torch.autograd.grad(weighted, logprob)
    (g_b,) = torch.autograd.grad(base, logprob)
    close(g_w, (g_b * w).tolist())


# ---- PF-PPO (verl's compute_pf_ppo_reweight_data) ----------------------------------------------
def test_pf_ppo_weights_by_hand():
    from core_algos import pf_ppo_weights
    s = torch.tensor([1.0, -2.0, 0.5, 0.0])
    torch.testing.assert_close(pf_ppo_weights(s, "pow", 2.0), torch.tensor([1.0, 4.0, 0.25, 0.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(s, "pow", 1.0), torch.tensor([1.0, 2.0, 0.5, 0.0]) + 1e-8)
    # max_min: the best (1.0) and the worst (-2.0) only
    torch.testing.assert_close(pf_ppo_weights(s, "max_min", 2.0), torch.tensor([1.0, 1.0, 0.0, 0.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(s, "max_random", 2.0), torch.tensor([0.4, 0.1, 0.1, 0.1]) + 1e-8)
    # ties at the top all count as the best
    torch.testing.assert_close(pf_ppo_weights(torch.tensor([1.0, 1.0, 0.0]), "max_random", 2.0),
                               torch.tensor([0.4, 0.4, 0.1]) + 1e-8)
    with pytest.raises(ValueError, match="max_min"):
        pf_ppo_weights(s, "softmax", 2.0)


def test_pf_ppo_resample_draws_in_proportion_to_the_weights():
    from core_algos import pf_ppo_resample
    g = torch.Generator().manual_seed(0)
    s = torch.tensor([1.0, -2.0, 0.5, 0.0])
    draws = torch.cat([pf_ppo_resample(s, "pow", 2.0, generator=g) for _ in range(5000)])   # 20,000 rows
    assert draws.shape == (20000,)
    share = torch.bincount(draws, minlength=4).double() / len(draws)
    torch.testing.assert_close(share, torch.tensor([1.0, 4.0, 0.25, 0.0], dtype=torch.float64) / 5.25, atol=0.01, rtol=0)
    assert share[3] == 0                                     # a zero score keeps only the 1e-8 floor
    only_extremes = pf_ppo_resample(s, "max_min", 2.0, generator=g)
    assert set(only_extremes.tolist()) <= {0, 1} and only_extremes.shape == (4,)
    # all-equal scores under max_min: every row is both best and worst, all drawable
    assert len(set(torch.cat([pf_ppo_resample(torch.zeros(3), "max_min", 2.0, generator=g)
                              for _ in range(50)]).tolist())) == 3


def test_bypass_logprob_diff_is_the_token_weighted_mean_of_the_first_mini_batch():
    """rollout_bypass_mode: rollout/logprob_diff is measured in the update's first mini-batch, and
    must be what the recompute path logs: the mean |sampler - actor| over every response token, not
    a mean of micro-batch means (micro-batches of 1 and 7 response tokens here, far apart)."""
    from contextlib import nullcontext
    from accelerate import Accelerator
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from config import Config
    from forward.batch import pack_batch
    from forward.readouts import response_logprobs
    from plumbing.oom import OomReaction, base_sizes
    import train_ppo
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).float()
    batch = pack_batch([[3, 4], [5, 6, 7]], [[8], [9, 10, 11, 12, 13, 14, 15]], pad_id=0)
    mask = batch["response_mask"]                                                 # [2, 7]: 1 and 7 tokens
    with torch.no_grad():
        actor, _ = response_logprobs(model, batch, 1.0)                           # [2, 7]
    batch["old_logprob"] = actor - torch.tensor([[4.0] * 7, [0.5] * 7])           # the sampler's: 4 and 0.5 off
    batch["advantages"] = torch.ones_like(mask)
    cfg = Config(rollout_bypass_mode=True, rollout_n=1, train_batch_size=2, ppo_mini_batch_size=2,
                 ppo_micro_batch_size_per_device=1, ppo_epochs=1, use_kl_loss=False)
    accelerator = Accelerator(cpu=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = train_ppo.update_actor(accelerator, model, optim, batch, cfg, nullcontext, False,
                                     oom=OomReaction(accelerator, base_sizes(cfg), cfg.max_oom_retries),
                                     max_grad_norm=cfg.max_grad_norm)
    expected = float(((batch["old_logprob"] - actor).abs() * mask).sum() / mask.sum())   # (4 + 7 * 0.5) / 8
    assert expected == pytest.approx(7.5 / 8, rel=1e-5)
    assert metrics["rollout/logprob_diff"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("scale", [10.0, 0.01])   # a gradient norm above max_grad_norm (clipped), below it (not)
def test_optimizer_step_clips_as_clip_grad_norm_and_leaves_a_gradient_under_the_limit_unwritten(scale):
    """optimizer_step without DeepSpeed: the same parameters, bit for bit, as clip_grad_norm_ then
    AdamW; the gradients are multiplied only when the norm is above the limit (their version
    counters move then and only then: a multiply by 1 is work that changes no bit)."""
    import train_ppo
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, fused=True) for m in models]
    grads = [torch.randn_like(p) * scale for p in models[0].parameters()]
    for m in models:
        for p, g in zip(m.parameters(), grads):
            p.grad = g.clone()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(models[1].parameters(), 1.0))
    optims[1].step()
    versions = [p.grad._version for p in models[0].parameters()]
    seen = []
    step = optims[0].step
    optims[0].step = lambda: (seen.extend(p.grad._version for p in models[0].parameters()), step())
    norm, skipped = train_ppo.optimizer_step(models[0], optims[0], 1.0, ds=False)
    assert (norm, skipped) == (expected_norm, False)
    assert (expected_norm > 1.0) == (scale > 1.0)
    assert all(p.grad is None for p in models[0].parameters())                       # zeroed after the step
    if scale > 1.0:
        assert all(after > before for after, before in zip(seen, versions))
    else:
        assert seen == versions
    for got, want in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(got, want)
