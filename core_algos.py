"""Pure math (verl 0.9.1's definitions, see docs/math.md): masked helpers, the advantage
estimators, the losses and agg_loss. Tensors in, tensors out; no config objects, no .item(), no
logging, no collectives. B sequences, T response tokens; mask is 1 on real response tokens.
"""
from __future__ import annotations

import math

import torch

import kl

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
REWARD_PLACEMENTS = ("last", "uniform", "decay")
PF_PPO_METHODS = ("pow", "max_min", "max_random")


def masked_sum(values, mask, dim=None):
    # where() rather than values * mask: a nan at a padded position must not leak in
    v = torch.where(mask.bool(), values, torch.zeros_like(values))
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(values, mask, dim=None):
    return masked_sum(values, mask, dim) / ((mask.sum() if dim is None else mask.sum(dim)) + 1e-8)


def masked_var(values, mask):
    """Unbiased variance over the valid positions (a single valid value gets no correction)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    return var * torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))


def masked_whiten(values, mask):
    """Zero mean, unit variance over the valid positions; padded positions are shifted too."""
    return (values - masked_mean(values, mask)) * torch.rsqrt(masked_var(values, mask) + 1e-8)


def entropy_from_logits(logits):
    # logsumexp - E_p[logits] == -sum p log p, without materialising log p
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)        # [B, T]


def compute_gae(token_rewards, values, mask, gamma, lam):
    """Generalised advantage estimation over right-padded responses -> (advantages, returns)."""
    with torch.no_grad():
        B, T = token_rewards.shape
        nextv = torch.zeros(B, dtype=values.dtype, device=values.device)         # [B]
        last = torch.zeros_like(nextv)                                            # [B]
        adv = torch.zeros_like(token_rewards)                                     # [B, T]
        for t in reversed(range(T)):
            m = mask[:, t].to(values.dtype)                                       # [B]
            delta = token_rewards[:, t] + gamma * nextv - values[:, t]            # [B]
            new = delta + gamma * lam * last                                      # [B]
            # padded steps pass the carry through unchanged
            nextv = values[:, t] * m + (1 - m) * nextv
            last = new * m + (1 - m) * last
            adv[:, t] = last
        returns = adv + values                                                    # [B, T]
        return masked_whiten(adv, mask), returns


def _group_stats(scores, group_ids, valid=None):
    """Per-sequence (mean, unbiased std, count) of its group's scores, over the group's valid
    samples only (valid [B] bool; None = all): a dropped sample is no part of any baseline."""
    w = torch.ones_like(scores) if valid is None else valid.to(scores.dtype)      # [B]
    scores = torch.where(w > 0, scores, torch.zeros_like(scores))                 # a dropped NaN must not leak
    _, inv = torch.unique(group_ids, return_inverse=True)                         # [B]
    count = torch.zeros(int(inv.max()) + 1, dtype=scores.dtype, device=scores.device).index_add_(0, inv, w)  # [G]
    mean = torch.zeros_like(count).index_add_(0, inv, scores * w) / count.clamp(min=1)                      # [G]
    sq = torch.zeros_like(count).index_add_(0, inv, (scores - mean[inv]) ** 2 * w)                           # [G]
    std = torch.sqrt(sq / (count - 1).clamp(min=1))                               # [G]
    return mean[inv], std[inv], count[inv]                                        # [B] each


def _drop(a, valid):
    """0 for dropped samples (whatever their score was, NaN included)."""
    return a if valid is None else torch.where(valid, a, torch.zeros_like(a))


def compute_grpo_advantages(token_rewards, mask, group_ids, norm_by_std=True, eps=1e-6, valid=None):
    """Score minus its group's mean (over std) -> (advantages, returns), equal. valid [B]: samples
    that count in their group's statistics (None = all)."""
    with torch.no_grad():
        scores = token_rewards.sum(-1)                                            # [B]
        mean, std, n = _group_stats(scores, group_ids, valid)
        mean = torch.where(n > 1, mean, torch.zeros_like(mean))   # a lone sample has no baseline
        std = torch.where(n > 1, std, torch.ones_like(std))
        a = (scores - mean) / (std + eps) if norm_by_std else scores - mean       # [B]
        adv = _drop(a, valid)[:, None] * mask                                                   # [B, T]
        return adv, adv


def compute_rloo_advantages(token_rewards, mask, group_ids, valid=None):
    """Leave-one-out baseline: score minus the mean of the group's other (valid) scores."""
    with torch.no_grad():
        scores = token_rewards.sum(-1)                                            # [B]
        mean, _, n = _group_stats(scores, group_ids, valid)
        k = n / (n - 1).clamp(min=1)
        a = torch.where(n > 1, scores * k - mean * k, scores)                     # [B]
        adv = _drop(a, valid)[:, None] * mask                                                   # [B, T]
        return adv, adv


def compute_reinforce_pp_advantages(token_rewards, mask, gamma):
    """REINFORCE++: discounted return-to-go, whitened over the batch."""
    with torch.no_grad():
        returns = torch.zeros_like(token_rewards)                                 # [B, T]
        running = torch.zeros_like(token_rewards[:, 0])                           # [B]
        for t in reversed(range(token_rewards.shape[1])):
            m = mask[:, t].to(token_rewards.dtype)
            new = token_rewards[:, t] + gamma * running
            returns[:, t] = new * m
            running = new * m + running * (1 - m)
        adv = masked_whiten(returns, mask) * mask                                 # [B, T]
        return adv, returns


def compute_reinforce_pp_baseline_advantages(token_rewards, mask, group_ids, valid=None):
    """REINFORCE++ with a group-mean baseline (over the group's valid samples), whitened over the batch."""
    with torch.no_grad():
        scores = token_rewards.sum(-1)                                            # [B]
        mean, _, n = _group_stats(scores, group_ids, valid)
        scores = scores - torch.where(n > 1, mean, torch.zeros_like(mean))
        x = _drop(scores, valid)[:, None] * mask                                                # [B, T]
        adv = masked_whiten(x, mask) * mask                                       # [B, T]
        return adv, adv


def agg_loss(loss_mat, mask, loss_agg_mode, num_tokens=None, num_seqs=None, seq_len=None):
    """Reduce a [B, T] loss to a scalar. num_tokens / num_seqs override the denominators (the
    whole mini-batch's counts, across micro-batches and ranks, so the pieces sum to the mini-batch
    loss); seq_len overrides T for seq-mean-token-sum-norm."""
    mask = mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return masked_sum(loss_mat, mask) / denom
    seq_sum = masked_sum(loss_mat, mask, dim=-1)                                  # [B]
    nonempty = (mask.sum(-1) > 0).to(loss_mat.dtype)                              # [B]
    n_seqs = nonempty.sum() if num_seqs is None else num_seqs
    if loss_agg_mode == "seq-mean-token-sum":
        return (seq_sum * nonempty).sum() / n_seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sum / (mask.sum(-1) + 1e-8) * nonempty).sum() / n_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        width = mask.shape[-1] if seq_len is None else seq_len
        return (seq_sum * nonempty).sum() / n_seqs / width
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def policy_loss(old_logprob, logprob, advantages, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                loss_agg_mode, is_weights=None, **agg):
    """Clipped surrogate with dual-clip -> (loss, {pg_clipfrac, ppo_kl, pg_clipfrac_lower}).
    is_weights [B, T]: rollout-correction weights (detached) multiplying each token's loss."""
    log_ratio = torch.clamp(logprob - old_logprob, -20.0, 20.0)                    # [B, T]
    ratio = torch.exp(log_ratio)                                                  # [B, T]
    ppo_kl = masked_mean(-log_ratio, mask)
    loss1 = -advantages * ratio                                                   # [B, T]
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)                                         # [B, T]
    pg_clipfrac = masked_mean((loss2 > loss1).float(), mask)
    # dual clip: with A < 0 a huge ratio would make the loss unbounded; cap it at -A * c
    loss3 = -advantages * clip_ratio_c                                            # [B, T]
    dual = torch.minimum(loss3, clipped)
    pg_clipfrac_lower = masked_mean(((clipped > loss3) & (advantages < 0)).float(), mask)
    per_token = torch.where(advantages < 0, dual, clipped)                        # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = agg_loss(per_token, mask, loss_agg_mode, **agg)
    return loss, {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": pg_clipfrac_lower}


def rollout_is_weights(old_logprob, sampler_logprob, mask, mode, threshold):
    """Truncated importance sampling of the sampler against the actor (the sampler's log-probs
    differ from the actor's: bf16, kernels, versions) -> (weights [B, T], {mean, max, clipped_frac}).
    token: w_t = min(exp(old_t - sampler_t), C); sequence: one weight per sequence,
    min(exp(sum_t (old_t - sampler_t)), C), on each of its tokens. No gradient flows through."""
    with torch.no_grad():
        log_w = (old_logprob - sampler_logprob) * mask                            # [B, T]
        if mode == "sequence":
            log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)                  # [B, T]
        raw = torch.exp(log_w.clamp(max=20.0))                                    # [B, T]
        weights = torch.clamp(raw, max=threshold) * mask                          # [B, T]
        stats = {"weight_mean": masked_mean(weights, mask),
                 "weight_max": torch.where(mask.bool(), weights, torch.zeros_like(weights)).max(),
                 "clipped_frac": masked_mean((raw > threshold).float(), mask)}
        return weights, stats


def value_loss(vpreds, returns, values, mask, cliprange_value, loss_agg_mode, **agg):
    """Clipped value loss -> (loss, vf_clipfrac)."""
    vclip = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)  # [B, T]
    err = (vpreds - returns) ** 2                                                 # [B, T]
    err_clip = (vclip - returns) ** 2                                             # [B, T]
    loss = 0.5 * agg_loss(torch.maximum(err, err_clip), mask, loss_agg_mode, **agg)
    return loss, masked_mean((err_clip > err).float(), mask)


def overlong_penalty(lengths, max_response_length, buffer_len, penalty_factor):
    """DAPO overlong shaping -> [B]: 0 up to max_response_length - buffer_len, then linearly down
    to -penalty_factor at max_response_length."""
    expected = max_response_length - buffer_len
    return torch.clamp(-(lengths - expected) / buffer_len * penalty_factor, max=0.0)


def place_scores(scores, mask, placement, decay):
    """One score per sequence spread over its response tokens -> [B, T], before KL and advantages.
    last: all of it on the last real token (verl). uniform: score / L on each of the L real tokens.
    decay: a token followed by k real tokens gets score * decay^k / (1 + decay + ... + decay^(L-1)),
    so the last token gets the largest share and decay=1 is uniform. Every placement keeps each
    sequence's total (what GRPO/RLOO compare); only where the credit lands changes."""
    if placement == "last":   # the last token of mask 1 (multi-turn: the policy's, never a tool token after it)
        positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)          # [B, T]
        last = torch.where(mask > 0, positions, -1).max(-1).values.clamp(min=0)               # [B]
        token_scores = torch.zeros(mask.shape, dtype=scores.dtype, device=mask.device)
        token_scores[torch.arange(len(scores)), last] = scores
        return token_scores                                                       # [B, T]
    if placement == "uniform":
        weights = mask                                                            # [B, T]
    elif placement == "decay":
        after = mask.flip(-1).cumsum(-1).flip(-1) - mask                          # [B, T] real tokens after t
        weights = torch.pow(torch.as_tensor(decay, dtype=scores.dtype), after) * mask   # [B, T]
    else:
        raise ValueError(f"placement must be one of {REWARD_PLACEMENTS}, got {placement!r}")
    weights = weights.to(scores.dtype)
    total = weights.sum(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)   # [B, 1]
    return scores.unsqueeze(-1) * weights / total                                 # [B, T]


def lr_factor(step, warmup_steps, total_steps, schedule, min_lr_ratio):
    """Learning-rate multiplier at a step (0-based): linear warmup, then constant or a half-cosine
    from 1 down to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def pf_ppo_weights(scores, method, weight_pow):
    """PF-PPO's (policy-filtered PPO) resampling weights from sequence scores [B], verl's rules:
    pow: |s|^weight_pow; max_min: 1 for the best and the worst score, 0 otherwise; max_random: 0.4
    for the best, 0.1 otherwise. A floor of 1e-8 keeps every row drawable (all-zero weights too)."""
    if method == "pow":
        w = scores.abs().pow(weight_pow)                                            # [B]
    elif method == "max_min":
        w = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)  # [B]
    elif method == "max_random":
        w = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)         # [B]
    else:
        raise ValueError(f"PF-PPO reweight method must be one of {PF_PPO_METHODS}, got {method!r}")
    return (w + 1e-8).clamp(min=1e-8)                                               # [B]


def pf_ppo_resample(scores, method, weight_pow, generator=None):
    """Row indices [B]: B draws with replacement in proportion to pf_ppo_weights (verl's
    compute_pf_ppo_reweight_data, which then takes every tensor of the batch at these rows)."""
    return torch.multinomial(pf_ppo_weights(scores, method, weight_pow), scores.shape[0], replacement=True,
                             generator=generator)                                   # [B]


def explained_variance(returns, values, mask):
    return 1 - masked_var(returns - values, mask) / (masked_var(returns, mask) + 1e-5)


def kl_in_reward(token_scores, old_logprob, ref_logprob, mask, beta, estimator):
    """Token rewards = scores - beta * KL -> (token_rewards, current_kl: mean over sequences of
    each sequence's mean KL, what the adaptive controller steers on)."""
    kld = kl.kl_penalty(old_logprob, ref_logprob, estimator) * mask               # [B, T]
    token_rewards = token_scores - beta * kld                                     # [B, T]
    current_kl = masked_mean(kld, mask, dim=-1).mean()
    return token_rewards, current_kl
