"""Log-prob and entropy of chosen tokens straight from hidden states, through the LM head in chunks.

    logprob, entropy = head_logprobs(hidden, weight, tokens, temperature)     # hidden [N, H] -> [N], [N]

The logits are the model's: `scale` and `softcap` reproduce what some models' forward does after
the head (Cohere's logit_scale, Granite's 1 / logits_scaling, Gemma 2/3's final soft-capping
softcap * tanh(x / softcap)), so z = softcap * tanh(scale * h W^T / softcap) / temperature.

The plain way, logits = hidden @ weight.T then log-softmax, holds an [N, V] tensor per
micro-batch and several more of the same size in its backward (the softmax, the gradient of the
logits, the gradient of the slice the logits came from). With a 32k-token vocabulary those
element-wise passes over N x V floats cost more than the matmuls. Here the logits exist one chunk
of rows at a time (`rows` x V, small enough to stay in cache): the forward keeps only the
log-sum-exp per row, and the backward recomputes each chunk's logits (one extra matmul) and turns
them straight into the gradients of hidden and weight. Same numbers as the plain way, up to fp32
rounding (tests/test_head_logprobs.py checks values and gradients against autograd).

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
import torch

CHUNK_ELEMENTS = 1 << 22    # logits per chunk on CPUs: 4M floats (16 MB), e.g. 128 rows of a 32k vocabulary
# on GPUs a chunk is a matmul: too few rows leave the device idle (13 rows of a 152k vocabulary
# cost one kernel launch and one full read of the [V, H] weight each), so chunks go by rows,
# at least CUDA_MIN_ROWS, and up to 256M logits (1 GB in fp32; a few such buffers live at once)
CUDA_MIN_ROWS = 1024
CUDA_CHUNK_ELEMENTS = 1 << 28


def chunk_rows(vocab: int, device_type: str) -> int:
    """Rows of hidden states whose logits are made at once, for a vocabulary of `vocab` on a device."""
    if device_type == "cuda":
        return max(CUDA_MIN_ROWS, CUDA_CHUNK_ELEMENTS // vocab)
    return max(1, CHUNK_ELEMENTS // vocab)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, compute_dtype, scale, softcap):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        rows = chunk_rows(weight.shape[0], hidden.device.type)
        logprob = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        w = weight.to(compute_dtype)
        for s in range(0, n, rows):
            z = _logits(hidden[s:s + rows], w, temperature, compute_dtype, scale, softcap)   # [r, V]
            lse[s:s + rows] = torch.logsumexp(z, dim=-1)
            logprob[s:s + rows] = z.gather(1, tokens[s:s + rows, None]).squeeze(1) - lse[s:s + rows]
            log_p = z.sub_(lse[s:s + rows, None])                                        # log-softmax, in place
            # -sum p log p: no cancellation between large terms (logsumexp - E_p[z] has it when entropy is low)
            entropy[s:s + rows] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(hidden, weight, tokens, lse, entropy)
        ctx.temperature, ctx.compute_dtype, ctx.scale, ctx.softcap = temperature, compute_dtype, scale, softcap
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, tokens, lse, entropy = ctx.saved_tensors
        t, dtype = ctx.temperature, ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        n = hidden.shape[0]
        rows = chunk_rows(weight.shape[0], hidden.device.type)
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, n, rows):
            h = hidden[s:s + rows]
            z = _logits(h, w, t, dtype, ctx.scale, ctx.softcap)                            # [r, V]
            # the soft-cap's derivative from its output: 1 - tanh^2, tanh = z * t / softcap
            capped = None if ctx.softcap is None else 1.0 - (z * (t / ctx.softcap)).square_()   # [r, V]
            log_p = z.sub_(lse[s:s + rows, None])
            p = log_p.exp()                                                               # softmax
            if grad_entropy is not None:   # -g_ent * p * (log p + H)
                gz = log_p.add_(entropy[s:s + rows, None]).mul_(p)
                gz.mul_(-grad_entropy[s:s + rows, None])
                if grad_logprob is not None:
                    gz.sub_(p.mul_(grad_logprob[s:s + rows, None]))
            else:
                gz = p.mul_(-grad_logprob[s:s + rows, None])
            if grad_logprob is not None:   # g_lp * (onehot - p): the onehot part
                gz.scatter_add_(1, tokens[s:s + rows, None], grad_logprob[s:s + rows, None].float())
            if t != 1.0:
                gz.div_(t)
            if capped is not None:
                gz.mul_(capped)
            if ctx.scale != 1.0:
                gz.mul_(ctx.scale)
            gz = gz.to(dtype)
            if need_h:
                grad_hidden[s:s + rows] = (gz @ w).to(hidden.dtype)
            if need_w:   # accumulated in fp32 whatever the compute dtype
                if dtype == torch.float32:
                    grad_weight.addmm_(gz.t(), h)
                elif gz.device.type == "cuda":   # the bf16 matmul accumulates into fp32: no [V, H] temporaries
                    torch.addmm(grad_weight, gz.t(), h.to(dtype), out_dtype=torch.float32, out=grad_weight)
                else:
                    grad_weight += (gz.t() @ h.to(dtype)).float()
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None)


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


def head_logprobs(hidden, weight, tokens, temperature: float = 1.0, scale: float = 1.0, softcap=None):
    """hidden [N, H], weight [V, H] (the LM head's), tokens [N] -> (logprob [N], entropy [N]), fp32.
    scale, softcap: the model's own logit post-processing (module docstring), applied before temperature.
    The matmuls run in the autocast dtype when autocast is on, otherwise in the weight's dtype."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    with torch.autocast(device_type, enabled=False):
        return _HeadLogprobs.apply(hidden, weight, tokens, float(temperature), dtype, float(scale),
                                   None if softcap is None else float(softcap))


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
