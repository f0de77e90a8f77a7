"""Log-prob and entropy of chosen tokens straight from hidden states, through the LM head in chunks.

    logprob, entropy = head_logprobs(hidden, weight, tokens, temperature)     # hidden [N, H] -> [N], [N]

The logits are the model's: `scale` and `softcap` reproduce what some models' forward does after
the head (Cohere's logit_scale, Granite's 1 / logits_scaling, Gemma 2/3's final soft-capping
softcap * tanh(x / softcap)), so z = softcap * tanh(scale * h W^T / softcap) / temperature.

The plain way, logits = hidden @ weight.T then log-softmax, holds an [N, V] tensor per
micro-batch and several more of the same size in its backward (the softmax, the gradient of the
logits, the gradient of the slice the logits came from). With a 32k-token vocabulary those
element-wise passes over N x V floats cost more than the matmuls. Here the logits exist one block
at a time (`blocks`: on a CPU a tile of rows x part of the vocabulary, small enough to stay in
cache, the log-sum-exp carried online across a row's tiles; on a GPU a chunk of whole rows): the
forward keeps only the log-sum-exp and entropy per row, and the backward recomputes each block's
logits (one extra matmul) and turns them straight into the gradients of hidden and weight. Same
numbers as the plain way, up to fp32 rounding (tests/test_packing.py and tests/test_head_fidelity.py
check values and gradients against autograd).

When the loss is a sum of per-row terms (PPO's update) and the caller says what it does to each
row (grad_of), the extra matmul goes: the forward keeps a row block's logits, block by block as
they are made, until the log-prob and entropy of those rows, and so the loss's gradient there,
are known, turns them into the gradients of hidden and weight, and lets them go; the backward
checks that the gradient that comes is that one, bit for bit, and hands them on. One row
block's logits live at a time (on CPUs up to KEPT_ELEMENTS: 512 rows of a 32k vocabulary); W5's
head (1,376 rows x 32,768 x 256) forward and backward took 568 -> 480 ms. Where the gradient can
only be the log-prob's (no entropy, no soft-cap) the forward keeps exp(z - m) instead of z, and
the softmax is then a multiply, not a second exponential (489 -> 476 ms). On a CPU no maximum is
subtracted at all there: a tile is exponentiated in place and summed, two passes instead of four,
where every row's log-sum-exp comes out in range (_unshifted_forward), and the gradients from those
exponentials take the softmax's scale and the one-hot on the rows' side of their matmuls
(_unshifted_logprob_grads): W5's actor micro-batch 553 -> 511 ms, then 578 -> 535 ms. Passes without
gradients sum the same way, the entropy read off log-sum-exp - sum p z beside it (_unshifted_forward),
by the same operations with and without the entropy: the reference's log-probs and the actor's old
ones are the same bits for the same weights (KL exactly 0 at the first step, as in verl); the
update's differ from them by fp32 rounding, as any other batching's.

Gradients flow from the log-prob and, when it is part of the loss, from the entropy:
  d logprob_i / d z_j = [j == token] - p_j
  d entropy   / d z_j = -p_j (log p_j + entropy)
with z the temperature-scaled logits and p = softmax(z); through the soft-cap and the scale,
d z / d (h W^T) = scale * (1 - tanh^2) / temperature.

    truncated = truncated_logprobs(hidden, weight, tokens, temperature, top_k, top_p)   # [N], no grad

is each token's log-prob under the distribution a top_k / top_p sampler draws from (vLLM's cut,
sampling_support, renormalised), in the same chunks: what the rollout engines report, to compare
with them like for like.
"""
import warnings
from contextlib import contextmanager

import torch

from forward import grad_blocks

CHUNK_ELEMENTS = 1 << 22    # truncated_logprobs' whole rows on CPUs: 4M floats (16 MB), e.g. 128 rows of a 32k vocabulary
# head_logprobs on CPUs: tiles of TILE_ROWS rows x TILE_COLS vocabulary entries (2 MB of logits), the
# log-sum-exp carried online across a row block's tiles. A tile's element-wise passes run in cache,
# where whole rows of a 32k vocabulary (16 MB a chunk) went to memory for each pass: W5's head
# (1,400 tokens x 32,768 x 256) took 320 -> 200 ms forward, 820 -> 630 ms forward and backward
TILE_ROWS = 512
TILE_COLS = 1024
# with grad_of a CPU row block's logits are kept until its gradients are made: at most 64 MB of
# them (a whole TILE_ROWS block of a 32k vocabulary, 110 rows of Qwen's 152k). W5's actor
# micro-batch (1,462 response tokens) 1,011 -> 920 ms at 32 MB; at 64 MB each [cols, H] slice of
# the weight is multiplied once per 512 rows instead of once per 256: W3's actor update 3.14 ->
# 3.02 s, W5's at 512 5.59 -> 5.51 s (medians of 4, alternating in one process), W3's peak RSS
# 20-33 MB up (1.124 -> 1.157 and 1.141 -> 1.160 GB, the heap keeps the larger block's pages)
KEPT_ELEMENTS = 1 << 24
# on GPUs a chunk is a matmul: too few rows leave the device idle (13 rows of a 152k vocabulary
# cost one kernel launch and one full read of the [V, H] weight each), so chunks go by rows,
# at least CUDA_MIN_ROWS, up to 256M logits (1 GB in fp32; a few such buffers live at once), and
# each holds the whole vocabulary
CUDA_MIN_ROWS = 1024
CUDA_CHUNK_ELEMENTS = 1 << 28


def chunk_rows(vocab: int, device_type: str) -> int:
    """Rows of hidden states whose logits over the whole vocabulary of `vocab` are made at once."""
    if device_type == "cuda":
        return max(CUDA_MIN_ROWS, CUDA_CHUNK_ELEMENTS // vocab)
    return max(1, CHUNK_ELEMENTS // vocab)


def blocks(vocab: int, device_type: str) -> tuple[int, int]:
    """(rows, columns) of the logits head_logprobs makes at once: CPU tiles, or GPU row chunks."""
    if device_type == "cpu":
        return TILE_ROWS, min(TILE_COLS, vocab)
    return chunk_rows(vocab, device_type), vocab


def kept_rows(vocab: int, device_type: str) -> int:
    """Rows of a block whose logits head_logprobs keeps for grad_of: on CPUs TILE_ROWS, fewer where
    that would keep more than KEPT_ELEMENTS logits; on GPUs a chunk (its logits are made at once anyway)."""
    rows = blocks(vocab, device_type)[0]
    return max(1, min(rows, KEPT_ELEMENTS // vocab)) if device_type == "cpu" else rows


def _block_forward(h, w, tokens, cols: int, t: float, dtype, scale, softcap, with_entropy: bool, keep=None,
                   shifted: bool = False):
    """h [r, H] -> (logprob, entropy, lse) [r] each, the vocabulary `cols` at a time. Per row it
    carries the largest logit so far m, total = sum exp(z - m) and spread = sum exp(z - m) (z - m),
    both rescaled when m grows; then lse = m + log total and the entropy -sum p log p =
    log total - spread / total: sums of small same-signed terms, exact also when the entropy is low.
    Without with_entropy the spread is not summed and the entropy is None. keep (a list): each
    block's logits are appended to it, as made, for the gradients (grad_of, _HeadLogprobs); where
    those can only be the log-prob's (no entropy, no soft-cap: _logprob_grads) the block's
    exp(z - m) and its m instead, as (e, m): p = e exp(m - lse) then costs a multiply, not a
    second exponential. For those gradients on a CPU the blocks are summed with no maximum
    subtracted where that stays in range (_unshifted_forward), keeping (exp(z), None); so are a CPU
    pass's without gradients (keep None, entropy or not) unless `shifted` (a pass with gradients
    but no grad_of, whose backward makes the logits again and subtracts this log-sum-exp)."""
    chosen = h.new_full((h.shape[0],), float("nan"), dtype=torch.float32)         # a token past the last block: NaN, not a stale number
    # grad_of's log-prob gradients, or a pass without gradients (keep None, not shifted)
    if softcap is None and h.device.type == "cpu" and (not with_entropy if keep is not None else not shifted):
        made = _unshifted_forward(h, w, tokens, cols, t, dtype, scale, chosen, with_entropy, keep)
        if made is not None:
            return made
    top = total = spread = None
    exps_kept = keep is not None and not with_entropy and softcap is None
    for j, v0 in enumerate(range(0, w.shape[0], cols)):
        z = _logits(h, w[v0:v0 + cols], t, dtype, scale, softcap)                  # [r, c]
        here = _in_block(tokens, cols, j, w.shape[0])
        chosen[here[0]] = z[here]
        m = z.amax(-1) if top is None else torch.maximum(top, z.amax(-1))          # [r]
        if keep is not None and not exps_kept:
            keep.append(z)
            z = z - m[:, None]
        else:
            z = z.sub_(m[:, None])
        e = z.exp() if with_entropy else z.exp_()                                  # z - m is read again for the spread
        if exps_kept:
            keep.append((e, m))
        if top is None:
            total, spread = e.sum(-1), (e * z).sum(-1) if with_entropy else None
        else:
            shift = top - m                                                        # <= 0
            grow = shift.exp()
            if with_entropy:
                spread = grow * (spread + total * shift) + (e * z).sum(-1)
            total = grow * total + e.sum(-1)
        top = m
    lse = top + total.log()
    return chosen - lse, total.log() - spread / total if with_entropy else None, lse


# _unshifted_forward's results stand where every row's log-sum-exp lies strictly inside: below 80
# no exp(z) overflowed (fp32's exp overflows past 88.7) nor did the sum (V e^80 < 3.4e38 up to a
# 2M-token vocabulary); above -60 the largest term, at least e^-60 / V, is a normal float
LSE_RANGE = (-60.0, 80.0)


def _unshifted_forward(h, w, tokens, cols: int, t: float, dtype, scale, chosen, with_entropy: bool, keep=None):
    """_block_forward on a CPU as sum exp(z), with no running maximum subtracted: two passes over each
    tile (exp, sum) instead of four (amax, subtract, exp, sum), and with the entropy sum exp(z) z
    beside them (four instead of six). Two callers:
    - the log-prob's gradients (grad_of, no entropy): keep is grad_of's list, each tile's (exp(z),
      None) appended. W5's actor micro-batch (1,400 response tokens, forward and gradients) 553 ->
      511 ms (medians of 7, alternating).
    - passes without gradients (the old and the reference log-probs; keep None). The log-sum-exp is
      made by the same operations in the same order whether or not the entropy is wanted, so the
      actor's old log-probs (with it) and the reference's (without) are the same bits for the same
      weights: the KL is exactly 0 at the first step, as in verl. The entropy is then its definition
      as verl computes it (entropy_from_logits: logsumexp - sum softmax * logits), a difference of two
      numbers of the logits' size, to fp32's rounding of them (about 1e-7 of the largest logit), where
      the shifted way is exact to fp32 also for entropies far below that. The forward phase's passes,
      medians of 5 alternating in one process: W5 at 512 (about 2,750 response tokens a step) the
      actor's 650 -> 557 ms, the reference's 580 -> 519; W3 325 -> 299 and 317 -> 288.
    The same log-sum-exp as the shifted way to fp32 rounding (the shift only keeps exp() in range, and
    the log-prob is z - lse either way), checked afterwards: -> (logprob, entropy or None, lse), or
    None where a row's log-sum-exp falls outside LSE_RANGE or is NaN (keep emptied of this block's
    entries; the caller runs the shifted way, for both passes alike)."""
    total = spread = None
    start = len(keep) if keep is not None else 0
    for j, v0 in enumerate(range(0, w.shape[0], cols)):
        z = _logits(h, w[v0:v0 + cols], t, dtype, scale, None)                     # [r, c]
        here = _in_block(tokens, cols, j, w.shape[0])
        chosen[here[0]] = z[here]
        e = torch.exp(z) if with_entropy else z.exp_()
        if keep is not None:
            keep.append((e, None))
        total = e.sum(-1) if total is None else total.add_(e.sum(-1))
        if with_entropy:
            ez = e.mul_(z).sum(-1)
            spread = ez if spread is None else spread.add_(ez)
    lse = total.log()
    if not bool(((lse > LSE_RANGE[0]) & (lse < LSE_RANGE[1])).all()):
        if keep is not None:
            del keep[start:]
        return None
    return chosen - lse, lse - spread / total if with_entropy else None, lse


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, compute_dtype, scale, softcap, with_entropy, grad_of, tied,
                gradless):
        ctx.set_materialize_grads(False)
        ctx.tied = tied if tied and tied.get("looked up") else None                     # tied_lookup's slot
        n = hidden.shape[0]
        rows, cols = blocks(weight.shape[0], hidden.device.type)
        logprob = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)   # [0]: not computed
        lse = hidden.new_empty(n, dtype=torch.float32)
        w = weight.to(compute_dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fused = grad_of is not None and (need_h or need_w) and n > 0
        if fused:   # the gradients made here, from each row block's logits while they exist (see head_logprobs)
            rows = kept_rows(weight.shape[0], hidden.device.type)
            grads = _zero_grads(hidden, weight, need_h, need_w)
            expected = [], []                                                      # the d loss / d output each block assumed
        for s in range(0, n, rows):
            h, tok = hidden[s:s + rows], tokens[s:s + rows]
            keep = [] if fused else None
            logprob[s:s + rows], block_entropy, lse[s:s + rows] = _block_forward(
                h, w, tok, cols, temperature, compute_dtype, scale, softcap, with_entropy, keep, shifted=not gradless)
            if with_entropy:
                entropy[s:s + rows] = block_entropy
            if fused:
                g_lp, g_ent = grad_of(s, s + h.shape[0], logprob[s:s + rows], block_entropy)   # [r] or None each
                expected[0].append(g_lp)
                expected[1].append(g_ent)
                if g_lp is not None or g_ent is not None:
                    _row_block_grads(h, w, tok, lse[s:s + rows, None], entropy[s:s + rows, None] if with_entropy else None,
                                     _column(g_lp), _column(g_ent), cols, temperature, compute_dtype, scale, softcap,
                                     grads[0][s:s + rows] if need_h else None, grads[1], kept=keep)
        ctx.save_for_backward(hidden, weight, tokens, lse, entropy)
        ctx.temperature, ctx.compute_dtype, ctx.scale, ctx.softcap = temperature, compute_dtype, scale, softcap
        ctx.made = (grads, *(None if not e or e[0] is None else torch.cat(e) for e in expected)) if fused else None
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, tokens, lse, entropy = ctx.saved_tensors
        t, dtype = ctx.temperature, ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None, None, None, None
        made, ctx.made = ctx.made, None
        if made is not None and _same(grad_logprob, made[1]) and _same(grad_entropy, made[2]):
            grad_hidden, grad_weight = made[0]                                     # what the forward assumed came
        else:
            if made is not None:
                made = None                                                        # not held beside the recompute's
                warnings.warn("head_logprobs: the loss's gradient was not the one grad_of described: the LM head's "
                              "gradients were made again (correct, at the cost of the work grad_of saves)")
            n = hidden.shape[0]
            rows, cols = blocks(weight.shape[0], hidden.device.type)
            w = weight.to(dtype)
            grad_hidden, grad_weight = _zero_grads(hidden, weight, need_h, need_w)
            for s in range(0, n, rows):
                _row_block_grads(hidden[s:s + rows], w, tokens[s:s + rows], lse[s:s + rows, None],
                                 entropy[s:s + rows, None] if entropy.numel() else None,
                                 None if grad_logprob is None else grad_logprob[s:s + rows, None],
                                 None if grad_entropy is None else grad_entropy[s:s + rows, None],
                                 cols, t, dtype, ctx.scale, ctx.softcap, grad_hidden[s:s + rows] if need_h else None,
                                 grad_weight)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        if grad_weight is not None and ctx.tied is not None:   # the tied lookup adds its rows and hands it on
            ctx.tied["grad"], grad_weight = grad_weight, None
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight,
                None, None, None, None, None, None, None, None, None)


def _zero_grads(hidden, weight, need_h: bool, need_w: bool):
    """(grad_hidden, grad_weight), fp32 zeros (None where not wanted): the blocks' matmuls accumulate
    into them over the vocabulary's blocks (hidden) and the row blocks (weight); the weight's block
    the last optimizer step's where one was kept (grad_blocks)."""
    return (torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None,
            grad_blocks.zeros(weight) if need_w else None)


def _column(g):
    return None if g is None else g[:, None]


def _same(got, assumed) -> bool:
    """Whether the gradient that came is, bit for bit, the one the forward assumed (None: none)."""
    if got is None or assumed is None:
        return got is assumed
    return torch.equal(got, assumed)


def _row_block_grads(h, w, tokens, lse, entropy, g_lp, g_ent, cols: int, t: float, dtype, scale, softcap,
                     grad_hidden, grad_weight, kept=None):
    """The gradients from one block of rows h [r, H] (lse, entropy, g_lp, g_ent [r, 1]; entropy and
    either g None where absent), added to grad_hidden [r, H] and grad_weight [V, H] (either None:
    not wanted). kept: what the forward kept of each block (consumed): its logits [r, c], or, where
    the gradient can only be the log-prob's, (exp(z - m) [r, c], m [r]) or (exp(z), None)
    (_block_forward); None: the logits are made again."""
    def z(j, v0):
        if kept is None:
            return _logits(h, w[v0:v0 + cols], t, dtype, scale, softcap)
        assert not isinstance(kept[j], tuple), "exp(z - m) kept for a gradient that needs z itself"
        return kept[j]
    if (g_ent is None and softcap is None and kept and dtype == torch.float32
            and all(isinstance(k, tuple) and k[1] is None for k in kept)
            and 0 <= int(tokens.min()) and int(tokens.max()) < w.shape[0] and float(lse.max()) <= FOLDED_LSE_MAX):
        _unshifted_logprob_grads(h, w, tokens, lse, g_lp, [e for e, _ in kept], cols, t, scale, grad_hidden,
                                 grad_weight)
        kept.clear()
        return
    if g_ent is None and softcap is None:
        def softmax(j, v0):
            if kept is not None and isinstance(kept[j], tuple):
                e, m = kept[j]
                return e.mul_((-lse if m is None else m[:, None] - lse).exp())       # exp(z - lse)
            return z(j, v0).sub_(lse).exp_()
        _logprob_grads(h, w, tokens, lse, g_lp, cols, t, dtype, scale, grad_hidden, grad_weight, softmax)
        return
    for j, v0 in enumerate(range(0, w.shape[0], cols)):
        wb = w[v0:v0 + cols]
        gz = _grad_logits(z(j, v0), lse, entropy, g_lp, g_ent, _in_block(tokens, cols, j, w.shape[0]),
                          t, scale, softcap).to(dtype)
        if grad_hidden is not None:
            _accumulate(grad_hidden, gz, wb)
        if grad_weight is not None:
            _accumulate(grad_weight[v0:v0 + cols], gz.t(), h.to(dtype))


# _unshifted_logprob_grads puts exp(-lse) onto the rows' side, a g_lp exp(-lse) h: with a log-sum-exp
# up to 40 (exp(-40) = 4e-18) that stays a normal float (above 1.2e-38) for a loss gradient above
# about 1e-20 on hidden states of order 1; above 40 the tiles are scaled as before
FOLDED_LSE_MAX = 40.0


def _unshifted_logprob_grads(h, w, tokens, lse, g_lp, exps, cols: int, t: float, scale: float, grad_hidden,
                             grad_weight):
    """_logprob_grads from the forward's exp(z) tiles (_unshifted_forward, fp32): p = exp(z) s with
    s = exp(-lse) per row, so d loss / d (h W^T) = -a (s exp(z) - onehot) with a = g_lp scale / t,
    and both sides' per-row factors go onto the [r, H] operands instead of each tile: grad_hidden
    gets -a (s sum_j exp(z_j) W_j - W[token]), grad_weight's tiles exp(z_j)^T (-a s h) and its
    tokens' rows a h. No pass over a tile but the two matmuls (where the softmax was a multiply and
    the onehot a scatter into each tile): W5's actor micro-batch of 1,400 response tokens, forward
    and gradients, 578 -> 535 ms; 512 tokens 235 -> 230 ms (medians of 9, alternating). fp32 only:
    in a 16-bit compute dtype s exp(z) - onehot must be made before rounding (_logprob_grads).
    Tiles consumed."""
    a = g_lp * (scale / t)                                                                # [r, 1]
    s = (-lse).exp()                                                                      # [r, 1]
    minus_ash = (-a * s) * h.float() if grad_weight is not None else None                 # [r, H]
    e_w = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if grad_hidden is not None else None
    for j, v0 in enumerate(range(0, w.shape[0], cols)):
        e = exps[j]
        if e_w is not None:
            e_w.addmm_(e, w[v0:v0 + cols])
        if minus_ash is not None:
            grad_weight[v0:v0 + cols].addmm_(e.t(), minus_ash)
        exps[j] = None
    if grad_hidden is not None:
        grad_hidden -= a * (e_w.mul_(s) - w.index_select(0, tokens).float())
    if grad_weight is not None:
        grad_weight.index_add_(0, tokens, a * h.float())


def _logprob_grads(h, w, tokens, lse, g_lp, cols: int, t: float, dtype, scale: float, grad_hidden, grad_weight,
                   softmax):
    """The gradients of the log-prob alone (no entropy in the loss, no soft-cap) from one block of
    rows h [r, H], added to grad_hidden [r, H] and grad_weight [V, H] (either None: not wanted).
    d loss / d (h W^T) = -a (p - onehot) with a = g_lp scale / t per row, so the per-element work
    on each tile is p - onehot alone, made in fp32 before any rounding to a 16-bit compute dtype
    (for a confident token p is close to 1); the factor a scales the [r, H] sides once.
    softmax(j, v0): the j-th block's softmax p [r, c], from v0 (made, or from what the forward kept;
    overwritten)."""
    a = g_lp * (scale / t)                                                                # [r, 1]
    minus_ah = (-a * h.float()).to(dtype) if grad_weight is not None else None            # [r, H]
    q_w = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if grad_hidden is not None else None   # sum q W
    minus_one = torch.tensor(-1.0, device=h.device)
    for j, v0 in enumerate(range(0, w.shape[0], cols)):
        wb = w[v0:v0 + cols]
        q = softmax(j, v0)                                                                  # [r, c]
        q = q.index_put_(_in_block(tokens, cols, j, w.shape[0]), minus_one, accumulate=True).to(dtype)   # p - onehot
        if q_w is not None:
            _accumulate(q_w, q, wb)
        if minus_ah is not None:
            _accumulate(grad_weight[v0:v0 + cols], q.t(), minus_ah)
    if grad_hidden is not None:
        grad_hidden -= a * q_w


def _in_block(tokens, cols: int, j: int, vocab: int):
    """(rows, columns) of the tokens [r] that lie in the j-th block of `cols` vocabulary entries,
    columns counted from the block's start. With the whole vocabulary in one block (GPUs), every
    row, found without waiting on the device."""
    if cols >= vocab:
        return torch.arange(tokens.shape[0], device=tokens.device), tokens
    here = (tokens // cols == j).nonzero().squeeze(1)
    return here, tokens[here] - j * cols


def _grad_logits(z, lse, entropy, g_lp, g_ent, chosen, t: float, scale: float, softcap):
    """d loss / d (h W^T) for one block of logits z [r, c] (temperature-scaled, post-processed):
    g_lp (onehot - p) - g_ent p (log p + H), through temperature, soft-cap and scale; `chosen`
    (rows, columns) places the onehot of the rows whose token lies in this block. Overwrites z."""
    # the soft-cap's derivative from its output: 1 - tanh^2, tanh = z * t / softcap
    capped = None if softcap is None else 1.0 - (z * (t / softcap)).square_()               # [r, c]
    log_p = z.sub_(lse)
    p = log_p.exp()                                                                        # softmax
    if g_ent is not None:   # -g_ent * p * (log p + H)
        gz = log_p.add_(entropy).mul_(p).mul_(-g_ent)
        if g_lp is not None:
            gz.sub_(p.mul_(g_lp))
    else:
        gz = p.mul_(-g_lp)
    if g_lp is not None:
        gz.index_put_(chosen, g_lp[chosen[0], 0], accumulate=True)
    if t != 1.0:
        gz.div_(t)
    if capped is not None:
        gz.mul_(capped)
    if scale != 1.0:
        gz.mul_(scale)
    return gz


def _accumulate(out, a, b):
    """out (fp32) += a @ b, whatever the compute dtype of a and b."""
    if a.dtype == torch.float32:
        out.addmm_(a, b)
    elif a.device.type == "cuda":   # the bf16 matmul accumulates into fp32: no temporaries
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out += (a @ b).float()


def head_matmul(hidden, weight):
    """hidden [r, H] @ weight[V, H]^T -> [r, V]. On a CPU as a view of weight @ hidden^T [V, r]:
    MKL runs a few rows against a large vocabulary up to 3x faster that way round (W5's head, 8
    rows x 256 -> 32,768: 6.0 against 2.1 ms; 128 rows: 1.4x), and elementwise work and both
    gradient matmuls read the transposed layout as it is. The same sums in another order."""
    if hidden.device.type == "cpu":
        return torch.mm(weight, hidden.t()).t()                                           # [r, V]
    return hidden @ weight.t()                                                            # [r, V]


def _logits(hidden, weight, temperature, dtype, scale=1.0, softcap=None):
    z = head_matmul(hidden.to(dtype), weight).float()                                    # [r, V]
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z = z.div_(softcap).tanh_().mul_(softcap)
    return z if temperature == 1.0 else z.div_(temperature)


def head_logprobs(hidden, weight, tokens, temperature: float = 1.0, scale: float = 1.0, softcap=None,
                  with_entropy: bool = True, grad_of=None, tied=None):
    """hidden [N, H], weight [V, H] (the LM head's), tokens [N] -> (logprob [N], entropy [N]), fp32;
    entropy None without with_entropy (one element-wise pass less per block).
    scale, softcap: the model's own logit post-processing (module docstring), applied before temperature.
    The matmuls run in the autocast dtype when autocast is on, otherwise in the weight's dtype.

    grad_of(start, stop, logprob [r], entropy [r] or None) -> (d loss / d logprob, d loss / d entropy)
    of rows start:stop ([r] each, None where the loss does not read it), for a loss that is a sum
    of per-row terms (PPO's): the gradients are then made in the forward, from each row block's
    logits while they are still there, and the backward hands them on: one matmul against the
    vocabulary less per row (of four), for one row block's logits ([rows, V] fp32) held meanwhile.
    The backward checks that the gradient that comes is, bit for bit, the one grad_of gave, and
    otherwise recomputes as without grad_of.
    tied: the slot of a tied_lookup active over the forward that made `hidden` (see there)."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    with torch.autocast(device_type, enabled=False):
        gradless = not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))
        logprob, entropy = _HeadLogprobs.apply(hidden, weight, tokens, float(temperature), dtype, float(scale),
                                               None if softcap is None else float(softcap), with_entropy, grad_of, tied,
                                               gradless)
    return logprob, entropy if with_entropy else None


@contextmanager
def tied_lookup(embedding, weight):
    """Over one forward pass whose LM head runs through head_logprobs on `weight`, the same tensor as
    the input `embedding`'s (tied), with gradients -> a slot for head_logprobs(tied=slot), else None.
    Autograd would give the tied weight two [V, H] gradients, the head's and the lookup's (a zeroed
    block with the looked-up rows added), and add one into the other: two blocks at the end of the
    actor's backward, each mapped and zeroed afresh (a 32k x 256 fp32 block is above glibc's largest
    mmap threshold). Here the head hands its weight gradient to the slot instead of to autograd, and
    the lookup adds its rows into it and hands it on: one block, no zeroing, no [V, H] addition. The
    head's backward always runs before the lookup's (the lookup's gradient comes through the head's
    input); a head whose backward does not come leaves the lookup its own gradient (own_lookup's).
    Only a plain nn.Embedding (no max_norm, scale_grad_by_freq or sparse) on a weight that takes
    gradients; an untied one (weight another tensor) gets own_lookup's."""
    if not _plain_lookup(embedding) or embedding.weight is not weight:
        with own_lookup(embedding):
            yield None
        return
    with _lookup(embedding, {}) as slot:
        yield slot


@contextmanager
def own_lookup(embedding):
    """Over one forward pass with gradients on a CPU: the plain `embedding`'s gradient rows added into
    grad_blocks' block for its weight (the last optimizer step's, zeroed, where one was kept), the
    same numbers as torch's own dense backward, which maps and zeroes a new [V, H] block each time.
    Elsewhere (another device, another kind of lookup, a partitioned weight) the lookup is as it is."""
    if not _plain_lookup(embedding) or embedding.weight.device.type != "cpu" or hasattr(embedding.weight, "ds_id"):
        yield
        return
    with _lookup(embedding, {}):
        yield


def _plain_lookup(embedding) -> bool:
    return (type(embedding) is torch.nn.Embedding and embedding.weight.requires_grad and torch.is_grad_enabled()
            and embedding.max_norm is None and not embedding.scale_grad_by_freq and not embedding.sparse
            and "forward" not in vars(embedding))


@contextmanager
def _lookup(embedding, slot: dict):
    embedding.forward = lambda ids: _TiedLookup.apply(ids, embedding.weight, embedding.padding_idx, slot)
    try:
        yield slot
    finally:
        del embedding.forward


class _TiedLookup(torch.autograd.Function):
    """F.embedding(ids, weight) whose weight gradient goes into the slot's (the tied head's), or, where
    the slot has none, into a block of its own: grad_blocks' for an fp32 weight on a CPU, torch's
    embedding_dense_backward's elsewhere."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, slot):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.slot, ctx.weight = padding_idx, slot, weight
        slot["looked up"] = True
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        weight, ctx.weight = ctx.weight, None
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        into = ctx.slot.pop("grad", None)
        if into is None and (grad.device.type != "cpu" or weight.dtype != torch.float32):
            padding = -1 if ctx.padding_idx is None else ctx.padding_idx
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, weight.shape[0], padding, False), None, None
        if into is None:   # torch's CPU backward adds the rows into zeros the same way (the same bits)
            into = grad_blocks.zeros(weight)
        rows, values = ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(into.dtype)
        if ctx.padding_idx is not None:                                                # its row takes no gradient
            keep = rows != ctx.padding_idx
            rows, values = rows[keep], values[keep]
        return None, into.index_add_(0, rows, values), None, None


def sampling_support(z, top_k: int = -1, top_p: float = 1.0):
    """z [r, V] temperature-scaled fp32 logits -> keep [r, V] bool: the tokens a sampler with
    top_k / top_p may draw, by vLLM's rules (v1 sampler, apply_top_k_top_p): top-k first, keeping
    every token whose logit ties the k-th largest; then top-p over the distribution renormalised to
    what top-k kept, dropping a token when it and all less likely ones hold at most 1 - top_p of
    the mass, so the token that crosses top_p stays, and the most likely always does. The sums run
    from the least likely up in fp32, as vLLM's do, so rounding at the boundary falls the same way."""
    V = z.shape[-1]
    top_k = top_k if 0 < top_k < V else 0
    if top_p >= 1.0:
        if not top_k:
            return torch.ones_like(z, dtype=torch.bool)                                  # [r, V]
        return z >= torch.topk(z, top_k, dim=-1).values[:, -1:]                          # [r, V]
    # the order of tied logits is the sort's: the same ops on the same values as vLLM
    ascending, order = z.sort(dim=-1)                                                    # [r, V]
    if top_k:
        ascending = ascending.masked_fill(ascending < ascending[:, V - top_k:V - top_k + 1], float("-inf"))
    mass_to_here = ascending.softmax(dim=-1).cumsum_(dim=-1)                             # [r, V]
    drop = mass_to_here <= 1 - torch.tensor(top_p, dtype=torch.float32)                  # fp32, as vLLM's
    drop[:, -1] = False
    return ~torch.zeros_like(drop).scatter_(-1, order, drop)                             # [r, V]


def support_logprobs(z, tokens, top_k: int = -1, top_p: float = 1.0):
    """z [r, V] temperature-scaled logits, tokens [r] -> [r]: log-prob of each token under softmax(z)
    cut to sampling_support and renormalised over what stays. A sampled token was kept by its
    sampler, so it stays here too: where the recomputed logits round across the boundary, its
    log-prob moves a little instead of becoming -inf."""
    keep = sampling_support(z, top_k, top_p).scatter_(1, tokens[:, None], True)        # [r, V]
    z = z.masked_fill(~keep, float("-inf"))                                              # [r, V]
    return z.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)          # [r]


@torch.no_grad()
def truncated_logprobs(hidden, weight, tokens, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                       scale: float = 1.0, softcap=None):
    """hidden [N, H], weight [V, H], tokens [N] -> [N] fp32: support_logprobs through the LM head,
    i.e. each token's log-prob under the distribution a top_k / top_p sampler draws from. No
    gradient (it checks the sampler, PPO's ratio uses the full distribution); chunked like
    head_logprobs, so the [N, V] logits never exist at once."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    rows = chunk_rows(weight.shape[0], hidden.device.type)
    out = hidden.new_empty(hidden.shape[0], dtype=torch.float32)                         # [N]
    with torch.autocast(device_type, enabled=False):
        w = weight.to(dtype)
        for s in range(0, hidden.shape[0], rows):
            z = _logits(hidden[s:s + rows], w, float(temperature), dtype, scale, softcap)  # [r, V]
            out[s:s + rows] = support_logprobs(z, tokens[s:s + rows], top_k, top_p)
    return out
