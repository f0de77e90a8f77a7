"""Decoding steps for decoders of the Llama form, run without generate() and without the model's
own forward, on the same weights (the hf engine's; rollout/hf.py).

A decoding step multiplies a few rows (one per sequence) by every weight: on a CPU the arithmetic
is small and each operation's fixed cost is not. generate() adds its own per-token work (its
stopping criteria, its input and mask bookkeeping), and the model's forward builds a 4-D mask,
the rotary angles and ~30 module calls a layer. Here a step is: the embedding, the rotary angles
once, and per layer the input norm, one matmul for q, k and v (their weights stacked), the
rotation (q and k in one), the KV cache's write, SDPA (grouped KV heads read in place), o with the
residual added in its epilogue, the post-attention norm, one matmul for gate and up, the model's
own activation, down (the residual added likewise); then the final norm and the model's own head.
A norm is F.rms_norm on the module's weight where that gives the module's output bit for bit
(_norm: Llama's and Qwen's RMSNorm), else the module. Each weight is in oneDNN's blocked layout
for the call (as rollout/hf.py's _decoding_linears packs the head). generate() calls against
these steps, alternating in one process (medians of 4): W5's 8 rows x 384 tokens 2.61 -> 2.02 s,
x 512 ending at EOS 3.52 -> 2.65 s, W3's 16 rows x 64 tokens 0.63 -> 0.54 s; the same tokens,
log-probs within 3e-6. The fused norms, the one rotation and the epilogue sums (the same bits):
W5's 8 rows x 128 tokens 0.941 -> 0.875 s (medians of 16, alternating, on a Zen 3 CPU).

Which models qualify is decided on the model, once (`unfit`): the CausalLM's base holds exactly
embed_tokens, layers, norm and rotary_emb; each layer exactly self_attn (q_proj, k_proj, v_proj,
o_proj: plain nn.Linear), mlp (gate_proj, up_proj, down_proj: plain nn.Linear, and act_fn),
input_layernorm and post_attention_layernorm, and no sliding window; and then a probe (two rows,
one left-padded, decoded token by token from an empty cache) must give the model's own logits
for each row's whole sequence. Whatever else a family does (scaled embeddings, soft-capped or
scaled logits, multipliers on the residual, another rotation, a norm inside the attention, no
rotation on some layers) moves the probe's logits and keeps it on generate(). At run time the
step stands aside (generate() runs) for another dtype than fp32, under autocast, off the CPU,
with a weight partitioned (ZeRO-3) or a projection hooked or patched, and where the cache is not
the engine's growing one filled up to the last prompt column.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ATTRIBUTE = "_lean_decoding_unfit"   # on a model: why it does not qualify ("" = it does), decided once
PROBE_ATOL = 1e-4                    # the probe's logits against the model's own, relative to their size
LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _base(model):
    return getattr(model, "model", None)


def _structure(model) -> str | None:
    """Why `model` is not of the Llama form (module names and kinds), or None."""
    base = _base(model)
    if base is None or {name for name, _ in base.named_children()} != {"embed_tokens", "layers", "norm", "rotary_emb"}:
        return "its base model is not embed_tokens, layers, norm and rotary_emb"
    if type(model.get_output_embeddings()) is not torch.nn.Linear:
        return "its LM head is not a plain nn.Linear"
    for layer in base.layers:
        if {name for name, _ in layer.named_children()} != LAYER:
            return f"a decoder layer ({type(layer).__name__}) is not {sorted(LAYER)}"
        attention, mlp = layer.self_attn, layer.mlp
        if {name for name, _ in attention.named_children()} != set(ATTENTION):
            return f"an attention ({type(attention).__name__}) is not {list(ATTENTION)}"
        if {name for name, _ in mlp.named_children()} != {*MLP, "act_fn"}:
            return f"an MLP ({type(mlp).__name__}) is not {list(MLP)} and act_fn"
        if any(type(getattr(module, name)) is not torch.nn.Linear
               for module, names in ((attention, ATTENTION), (mlp, MLP)) for name in names):
            return "a projection is not a plain nn.Linear"
        if getattr(attention, "sliding_window", None) is not None or not hasattr(attention, "scaling"):
            return "an attention has a sliding window or no scaling"
    if getattr(model.config, "sliding_window", None) is not None and getattr(model.config, "layer_types", None) is None:
        return "its config has a sliding window"
    return None


def unfit(model) -> str | None:
    """Why the lean step cannot decode `model` (the structure, then the probe), or None. Decided on
    the first call and kept on the model."""
    reason = getattr(model, ATTRIBUTE, None)
    if reason is None:
        reason = _structure(model) or _probe(model) or ""
        setattr(model, ATTRIBUTE, reason)
    return reason or None


class Step:
    """The lean step on `model`'s current weights, packed for one generate() call (decoder())."""

    def __init__(self, model, packed: list):
        base = _base(model)
        self.model, self.base, self.layers = model, base, list(base.layers)
        self.packed = packed                                             # per layer: (qkv, qkv bias, o, gate-up, down)
        self.norms = [(_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)) for layer in self.layers]
        self.final_norm = _norm(base.norm)
        attention = self.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = getattr(model.config, "num_key_value_heads", None) or self.heads
        self.head_dim = attention.head_dim
        self.intermediate = self.layers[0].mlp.gate_proj.out_features

    def __call__(self, tokens, positions, cache, see):
        """Logits [a, V] for tokens [a] at positions [a], each row's keys and values written into
        `cache` (its layers' update()); see [a, C]: the cache columns each row attends to, this
        step's included."""
        a, d = tokens.shape[0], self.head_dim
        x = self.base.embed_tokens(tokens)                                                  # [a, H]
        cos, sin = self.base.rotary_emb(x[:, None], positions[:, None])                     # [a, 1, d] each
        h, k_end = self.heads, (self.heads + self.kv_heads) * d
        mask = see[:, None, None, :]                                                        # [a, 1, 1, C]
        for layer, slot, (input_norm, post_norm), (qkv_w, qkv_b, o_w, o_b, gu_w, gu_b, down_w, down_b) in zip(
                self.layers, cache.layers, self.norms, self.packed):
            qkv = _linear(input_norm(x), qkv_w, qkv_b)                                      # [a, (h + 2 kv) d]
            qk = _rotated(qkv[:, :k_end].view(a, h + self.kv_heads, d), cos, sin)           # [a, h + kv, d]
            keys, values = slot.update(qk[:, h:, None], qkv[:, k_end:].view(a, self.kv_heads, 1, d))   # [a, kv, C, d]
            out = F.scaled_dot_product_attention(qk[:, :h, None], keys, values, attn_mask=mask,
                                                 scale=layer.self_attn.scaling,
                                                 enable_gqa=self.kv_heads != h)             # [a, h, 1, d]
            x = _linear_added(out.reshape(a, h * d), o_w, o_b, x)                           # x + o(out)
            gate_up = _linear(post_norm(x), gu_w, gu_b)                                     # [a, 2 I]
            mid = layer.mlp.act_fn(gate_up[:, :self.intermediate]).mul_(gate_up[:, self.intermediate:])
            x = _linear_added(mid, down_w, down_b, x)                                       # x + down(mid)
        return self.model.get_output_embeddings()(self.final_norm(x))                      # [a, V]


def decoder(model) -> Step | None:
    """The lean step for one generate() call on `model`, its weights packed now, or None where it
    stands aside (see the module's docstring)."""
    weight = model.get_input_embeddings().weight
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
            or not torch.backends.mkldnn.is_available() or _structure(model) or not _placed(model) or unfit(model)):
        return None
    return _packed_step(model)


def _placed(model) -> bool:
    """Whether the step may run the weights itself: no projection (whose module it does not call)
    hooked or patched, no weight partitioned (ZeRO-3) or placed by Accelerate's hooks. The modules
    it calls (embedding, norms, activations, rotary, head) run their own hooks."""
    base = _base(model)
    projections = [getattr(parent, name) for layer in base.layers
                   for parent, names in ((layer.self_attn, ATTENTION), (layer.mlp, MLP)) for name in names]
    return not (any(_hooked(m) for m in projections) or any(
        hasattr(m, "_hf_hook") or any(hasattr(p, "ds_id") for p in m.parameters(recurse=False))
        for m in model.modules()))


def _hooked(module) -> bool:
    """Whether a forward hook is on `module` or its forward is patched on the instance."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))


def _packed_step(model) -> Step:
    packed = []
    for layer in _base(model).layers:
        q, k, v, o = (getattr(layer.self_attn, name) for name in ATTENTION)
        gate, up, down = (getattr(layer.mlp, name) for name in MLP)
        packed.append((*_stacked(q, k, v), *_stacked(o), *_stacked(gate, up), *_stacked(down)))
    return Step(model, packed)


def generate(step: Step, ids, mask, cache, max_new_tokens: int, sampler, eos_ids):
    """generate()'s greedy decoding over the engine's Sampler (its draw, not the one-hot scores
    generate() takes the argmax of), or over the logits where sampler is None, from a
    left-padded batch ids, mask [a, W] whose cache holds every column but the last: ids with up to
    max_new_tokens columns more, the same tokens up to each row's first of eos_ids (a list, or None:
    no stop). A row that drew one draws on (where generate() writes its pad token: the engine cuts
    a response at its first stop token either way) until every row has, and the call ends there."""
    a, width = ids.shape
    see = torch.cat([mask.bool(), mask.new_ones(a, max_new_tokens, dtype=torch.bool)], dim=1)   # [a, W + n]
    positions = mask.sum(-1) - 1                                                       # [a] the last column's
    eos = None if eos_ids is None else torch.tensor(eos_ids, device=ids.device)
    ended = torch.zeros(a, dtype=torch.bool, device=ids.device)
    tokens, drawn = ids[:, -1], []
    for s in range(max_new_tokens):
        logits = step(tokens, positions + s, cache, see[:, :width + s])                  # [a, V]
        tokens = logits.float().argmax(-1) if sampler is None else sampler.draw(logits)[1][:, 0]   # [a]
        drawn.append(tokens)
        if eos is not None:
            ended |= torch.isin(tokens, eos)
            if bool(ended.all()):
                break
    return torch.cat([ids, torch.stack(drawn, dim=1)], dim=1)                          # [a, W + steps]


def _stacked(*linears):
    """(weight, bias) of these nn.Linear stacked along their outputs, the weight packed for oneDNN;
    the bias None where none has one (zeros for those without, where another has one)."""
    weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    if all(m.bias is None for m in linears):
        return packed, None
    return packed, torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                              for m in linears])


def _linear(x, packed, bias):
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _linear_added(x, packed, bias, residual):
    """residual + (x W^T + b), the sum in the matmul's epilogue (oneDNN's binary post-op): the same
    fp32 addition as after it, one operation fewer."""
    return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual, packed, bias, "add")


def _norm(module):
    """The norm `module` as the step calls it: F.rms_norm on its weight and epsilon where that gives
    the module's own output bit for bit on a probe (Llama's and Qwen's RMSNorm: one operation
    instead of seven and a module call), else the module itself (another form of norm, a hook)."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (_hooked(module) or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float)):
        return module
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight) * 4   # [3, H]

    def fused(x):
        return F.rms_norm(x, weight.shape, weight, eps)
    return fused if torch.equal(fused(probe), module(probe)) else module


def _rotated(x, cos, sin):
    """The rotary embedding (Llama's rotate_half form) of x [a, heads, d] by cos and sin [a, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _probe(model) -> str | None:
    """Two rows, the second left-padded by two columns, decoded by the lean step token by token
    from an empty cache: their logits must be the model's own forward's on each row's sequence
    alone, relative to the logits' size; else why not."""
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    rows = [torch.arange(3, 9, device=device) * 5 % vocab, torch.arange(4, 8, device=device) * 7 % vocab]   # 6 and 4
    width = 6
    ids = torch.stack([rows[0], torch.cat([rows[0][:2], rows[1]])])             # [2, 6], row 1's first 2: padding
    see = torch.ones(2, width, dtype=torch.bool, device=device)
    see[1, :2] = False
    positions = (see.long().cumsum(-1) - 1).masked_fill_(~see, 1)                # as generate() numbers them
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own = [model(input_ids=r[None], use_cache=False).logits[0].float() for r in rows]   # [n, V] each
            step, cache = _packed_step(model), _ProbeCache(len(_base(model).layers))
            got = torch.stack([step(ids[:, c], positions[:, c], cache, see[:, :c + 1]).float()
                               for c in range(width)], dim=1)                    # [2, 6, V]
    except Exception as e:   # a family whose modules take other arguments
        return f"the lean step fails on it: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    finally:
        model.train(was_training)
    error = max(float((got[0] - own[0]).abs().max()) / max(1.0, float(own[0].abs().max())),
                float((got[1, 2:] - own[1]).abs().max()) / max(1.0, float(own[1].abs().max())))
    if not error <= PROBE_ATOL:
        return f"the lean step's logits differ from its own forward's (relative difference {error:.2g})"
    return None


class _ProbeCache:
    """The probe's KV cache: per layer, the keys and values of the steps so far, concatenated (the
    engine's own cache is held to generate()'s by the registry's sampling tests)."""

    class Layer:
        def __init__(self):
            self.keys = self.values = None

        def update(self, keys, values):
            self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=-2)
            self.values = values if self.values is None else torch.cat([self.values, values], dim=-2)
            return self.keys, self.values

    def __init__(self, layers: int):
        self.layers = [self.Layer() for _ in range(layers)]
