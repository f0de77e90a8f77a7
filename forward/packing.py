"""Micro-batches without padding: the sequences of a micro-batch packed end to end in one row.

A rollout micro-batch is [B, P + R]: prompts left-padded to the longest prompt, responses
right-padded to the longest response. With prompts of very different lengths most of that can be
padding, and every layer computes on it. Packed, the same tokens are one row [1, T] with T the sum
of the real lengths, positions restarting at 0 for each sequence, and attention kept inside each
sequence:

    packed = pack(micro_batch)                  # input_ids/position_ids [1, T], where the outputs are
    with packing.attention():                   # models loaded with attn_implementation=NAME
        out = model(**packed.model_inputs(), ...)
    per_position[packed.response_index]         # [1, T, ...] -> [B, R, ...]

On GPUs with flash-attention (attn_implementation flash_attention_2/3) Transformers reads the
sequence boundaries from the cu_seq_lens_* arguments and runs its varlen kernels. Elsewhere the
models use NAME: SDPA run once per sequence, causal within it, so no [T, T] mask is built and no
score is computed across sequences. Outside `attention()` NAME is plain SDPA (generation, padded
batches). Results equal the padded forward's up to float rounding (tests/test_packing.py).
"""
from contextlib import contextmanager

import torch
import torch.nn.functional as F

NAME = "sdpa_packed"
PACKED_ATTENTION = (NAME, "flash_attention_2", "flash_attention_3")   # attn_implementation values that take packed rows
_active = False


@contextmanager
def attention():
    """While active, NAME's mask builder returns no mask: the packed attention needs none."""
    global _active
    before, _active = _active, True
    try:
        yield
    finally:
        _active = before


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None,
               softcap=None, s_aux=None, **kwargs):
    cu = kwargs.get("cu_seq_lens_q")
    extras = softcap is not None or s_aux is not None      # what SDPA cannot do: the explicit form below
    groups = getattr(module, "num_key_value_groups", 1)
    if cu is None and not extras:
        if groups > 1 and _grouped_in_place(query, key, value, attention_mask, kwargs):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                 scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None                        # [b, T, h, d]
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if groups > 1:                                   # [b, kv, T, d] -> [b, kv * groups, T, d], as repeat_kv
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    drop = dropout if module.training else 0.0
    if cu is None:   # a padded batch: the mask transformers built (window included), or causal when it built none
        n = query.shape[2]
        see = attention_mask if attention_mask is not None else _band(n, sliding_window, query.device)
        if see.dtype != torch.bool:
            see = see == 0                           # an additive float mask: 0 where attended
        out = _attention_with_extras(query, key, value, scale, see, softcap, s_aux, drop)
        return out.transpose(1, 2).contiguous(), None                            # [b, T, h, d]
    lengths = (cu[1:] - cu[:-1]).tolist()
    out = []
    # split, not slices: its backward is one concatenation, where each slice's would be a full-size zero tensor
    for q, k, v in zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2)):
        n = q.shape[2]
        window = sliding_window if sliding_window is not None and sliding_window < n else None
        if extras:
            out.append(_attention_with_extras(q, k, v, scale, _band(n, window, q.device), softcap, s_aux, drop))
        elif window is None and not drop and _reused(q, k, v):   # in a checkpointed layer: see reuse_contexts
            out.append(_ReusableAttention.apply(q, k, v, scale))
        else:   # SDPA's causal kernel where the window covers the sequence, a banded mask only where it bites
            mask = None if window is None else _band(n, window, q.device)
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop,
                                                      is_causal=mask is None, scale=scale))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None            # [1, T, h, d]


packed_attention = _attention   # what forward/ulysses.py runs on the whole row between its all-to-alls


# Gradient checkpointing runs a layer's forward again in the backward pass, its attention kernel
# included, though the kernel's backward needs only its output and log-sum-exp besides q, k and v
# (which the layer's projections, cheap next to it, recompute). reuse_contexts is the checkpoint's
# context_fn: each checkpointed call gets a store of its own; its first forward keeps each
# sequence's attention output and log-sum-exp there (hidden floats a token), and its recompute
# takes them back in the same order instead of running the kernel again. Same numbers, the
# kernel's forward once instead of twice (CPU flash attention: causal, no dropout or window,
# no autocast, q, k and v of one dtype and head size). A forward whose backward never comes (an
# OOM retry) leaves its store to be freed with its graph; two forwards never share one.
_store = None   # (the running checkpointed call's store, "keep" | "take"), or None


@contextmanager
def _using(store: list, mode: str):
    global _store
    before, _store = _store, (store, mode)
    try:
        yield
    finally:
        _store = before


def reuse_contexts():
    """torch.utils.checkpoint's context_fn (non-reentrant): (the first forward's context, the recompute's)."""
    store = []
    return _using(store, "keep"), _using(store, "take")


def _reused(q, k, v) -> bool:
    return (_store is not None and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.float32, torch.bfloat16) and q.shape[-1] == k.shape[-1] == v.shape[-1]
            and not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled() and q.requires_grad)


class _ReusableAttention(torch.autograd.Function):
    """Causal attention of one sequence (CPU flash attention, what SDPA runs there), kept in the
    checkpointed call's store in its first forward and taken back in its recompute."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        store, mode = _store
        kept = store.pop(0) if mode == "take" and store else None
        if kept is None or kept[0].shape != q.shape:
            kept = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
            if mode == "keep":
                store.append(tuple(x.detach() for x in kept))   # other tensors: autograd marks the returned one
        out, lse = kept
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, k, v, out, lse, 0.0, True, scale=ctx.scale)
        return dq, dk, dv, None


def _grouped_in_place(query, key, value, attention_mask, kwargs) -> bool:
    """Whether SDPA can read grouped KV heads in place (enable_gqa) where Transformers would copy
    them: with a mask (left-padded generation, padded micro-batches) it repeats every KV head
    group-fold, for CUDA's fast kernels, which take no mask with grouped heads. CPU's SDPA takes
    both, with the same result (the KV-cache copy was 31% of a 2,048-token generation on W5's
    model). Only the plain case: a boolean or additive mask, no position bias or paged cache."""
    return (query.device.type == "cpu" and attention_mask is not None and key.shape[-1] == value.shape[-1]
            and kwargs.get("position_bias") is None and kwargs.get("cache") is None)


def _band(n: int, window, device):
    """[n, n] bool, True where query i sees key j: causal, and within `window` tokens when given
    (j > i - window, transformers' sliding-window convention)."""
    i = torch.arange(n, device=device)
    see = i[None, :] <= i[:, None]                                                # [n, n]
    return see if window is None else see & (i[None, :] > i[:, None] - window)


def _attention_with_extras(q, k, v, scale, see, softcap, sinks, dropout):
    """One sequence's attention with what SDPA lacks: logits soft-capped (softcap * tanh(s / softcap),
    Gemma 2) and per-head sink logits that join the softmax and are dropped after (s_aux, gpt-oss)."""
    scores = (q @ k.transpose(-1, -2)) * scale                                    # [b, h, n, n]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~see, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)   # [b, h, n, 1]
        scores = torch.cat([scores, sink], dim=-1)                                # [b, h, n, n + 1]
        # the max over the real logits and the sink keeps exp() in range, as the models' eager path does
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores.float(), dim=-1)[..., :-1].to(q.dtype)      # [b, h, n, n]
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)                # [b, h, n, n]
    probs = F.dropout(probs, p=dropout) if dropout else probs
    return probs @ v                                                              # [b, h, n, d]


def _mask(*args, **kwargs):
    if _active:
        return None
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make NAME known to Transformers (idempotent) -> NAME, for attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def unpackable(model, atol: float = 1e-3):
    """Why `model` (attn_implementation NAME) cannot run packed rows, or None when it can: the
    model run once on two short sequences packed in one row must give what it gives on each
    alone. Catches whatever the packed attention does not honour (state carried along the row by
    recurrent or convolutional layers, attention biases, sparse attention indices, ...), once,
    before training, on the real model. Differences are relative to the outputs' size."""
    lengths = (7, 5)
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    seqs = [torch.arange(3, 3 + n, device=device) * (i + 2) % vocab for i, n in enumerate(lengths)]   # [n] each
    row = torch.cat(seqs)[None]                                                    # [1, T]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]   # [1, T]
    packed = Packed(row, positions, cu, None, None)
    try:
        with torch.no_grad():
            # the last hidden state: per position whatever the head (a reward model pools its logits)
            alone = [model(input_ids=x[None], use_cache=False, output_hidden_states=True).hidden_states[-1][0].float()
                     for x in seqs]                                                # [n, H] each
            with attention():
                together = model(**packed.model_inputs(), use_cache=False,
                                 output_hidden_states=True).hidden_states[-1][0].float()           # [T, H]
    except Exception as e:   # the model refuses the packed inputs (cu_seq_lens_*, restarting positions)
        return f"its forward fails on a packed row: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    alone = torch.cat(alone)                                                       # [T, H]
    error = float((together - alone).abs().max()) / max(1.0, float(alone.abs().max()))
    if not error <= atol:
        return f"packed sequences change its outputs (relative difference {error:.2g}): some layer mixes them"
    return None


class Packed:
    """One micro-batch packed: the model's inputs and where each row's outputs are."""

    def __init__(self, input_ids, position_ids, cu_seqlens, response_index, last_index):
        self.input_ids = input_ids               # [1, T]
        self.position_ids = position_ids         # [1, T]
        self.cu_seqlens = cu_seqlens             # [B + 1], int32: sequence i is [cu[i], cu[i + 1])
        self.response_index = response_index     # [B, R]: the position predicting response token j of row i
        self.last_index = last_index             # [B]: the last real token of row i

    def model_inputs(self) -> dict:
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": longest, "max_length_k": longest}


def worth_it(batch: dict, costs: tuple[float, float] = (1.0, 0.0), min_saving: float = 0.1) -> bool:
    """Whether packing saves at least min_saving of the micro-batch's work. Below that the padded
    layout is kept: one batched SDPA call per layer instead of one per sequence (on short sequences
    with little padding the two measure alike).

    costs (`costs(model)`): the model's work per position and per (query, key) pair. Packed, a
    sequence of L tokens costs L positions and the L^2 / 2 pairs of its causal kernel. Padded, every
    row costs the width W in positions, and its attention W^2 pairs: with padding SDPA takes a mask and
    computes every query against every key (W^2 / 2 without, causal). So long sequences of alike
    lengths pack too: 768-token responses after 200-241-token prompts on W3's model are 2% padding,
    and the attention is 40% of the padded pass's work, which packing halves. Without costs,
    positions alone."""
    mask = batch["attention_mask"]
    rows, width = mask.shape
    lengths = mask.sum(-1).double()                                               # [B]
    position, pair = costs
    padded_pairs = width if bool((lengths < width).any()) else width / 2
    padded = rows * width * (position + pair * padded_pairs)
    packed = float((lengths * (position + pair * lengths / 2)).sum())
    return packed <= (1.0 - min_saving) * padded


def costs(model) -> tuple[float, float]:
    """(FLOPs per position, FLOPs per attended (query, key) pair) of a forward pass of `model` (a Hugging
    Face model, unwrapped), for worth_it: its linear layers less the output head (which runs on the
    positions read, packed or not), and plumbing.flops' attention count. Read once per model."""
    cached = getattr(model, "_packing_costs", None)
    if cached is None:
        from plumbing import flops
        shape = flops.shape_of(model)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head_weights = head.in_features * head.out_features if isinstance(head, torch.nn.Linear) else 0
        cached = (2.0 * (shape.linear_weights - head_weights), 4.0 * shape.attn_layers * shape.attn_width)
        model._packing_costs = cached
    return cached


def pack(batch: dict) -> Packed:
    """A micro-batch as pack_batch lays it out ([B, P + R], prompts left-padded, responses
    right-padded, attention_mask 1 on real tokens) -> Packed. Positions of padded response tokens
    point at their sequence's last token: their outputs are masked out downstream."""
    mask = batch["attention_mask"].bool()                                          # [B, W]
    R = batch["responses"].shape[1]
    P = mask.shape[1] - R
    lengths = mask.sum(-1)                                                         # [B]
    prompt_lengths = mask[:, :P].sum(-1)                                           # [B]
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = lengths.cumsum(0)
    starts = cu[:-1].long()                                                        # [B]
    ends = cu[1:].long()                                                           # [B]
    steps = torch.arange(R, device=mask.device)                                    # [R]
    # the token before response token j sits at start + prompt_length - 1 + j
    response_index = (starts + prompt_lengths - 1)[:, None] + steps[None, :]       # [B, R]
    response_index = torch.minimum(response_index, (ends - 1)[:, None])
    return Packed(input_ids=batch["input_ids"][mask][None], position_ids=batch["position_ids"][mask][None],
                  cu_seqlens=cu, response_index=response_index, last_index=ends - 1)
