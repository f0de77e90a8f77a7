"""The forward paths that read a model: the actor's and ref's per-token log-probs (through the LM
head, packed rows where that saves work), the critic's values and the reward model's scores.
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from core_algos import entropy_from_logits
from forward import last_layer, packing, ulysses
from forward.batch import spread
from forward.head_logprobs import head_logprobs, own_lookup, support_logprobs, tied_lookup, truncated_logprobs


def response_logprobs(model, batch: dict, temperature: float, with_entropy: bool = False,
                      entropy_grad: bool = False, truncation: tuple[int, float] | None = None, loss_of=None):
    """Log-prob (and entropy) of each response token under `model` -> [B, R] each; with
    truncation=(top_k, top_p) also, third, the log-prob under the distribution a sampler with those
    settings draws from (cut and renormalised, no grad), from the same forward pass.
    Only the positions that predict response tokens reach the LM head (the numbers after a shorter
    response's end are 0). There the chunked head_logprobs takes the head's input and computes both
    without ever holding the [B, R, V] logits; the head itself is handed an empty input, and the
    model's own logit scale and soft-cap (load_models' head_transform) are applied there. Where
    that cannot be done (a head with a bias or an adapter, other post-processing of the logits, or
    ZeRO-3, whose partitioned weight exists only inside the head's own forward) the logits are made
    and reduced one sequence at a time. The entropy builds a graph only when it is part of the loss
    (entropy_grad).
    loss_of(logprob, entropy) -> the loss these feed, where it is a sum of per-token terms (PPO's
    update): given, the chunked head makes that loss's gradients in its forward pass, while each
    block's logits are there (head_logprobs' grad_of: one matmul against the vocabulary less)."""
    if ulysses.size() > 1:
        return _sharded_logprobs(model, batch, temperature, with_entropy, entropy_grad, truncation)
    B, R = batch["responses"].shape
    # only response tokens reach the head, not the padding after the shorter responses (their
    # numbers are 0): with responses of very different lengths that padding was up to half the work
    real = batch["attention_mask"][:, -R:].reshape(-1).bool()                    # [B * R]
    head, transform, fused, captured, hook = _head_input(model)
    try:   # a tied input embedding adds its gradient rows into the head's (one [V, H] block, not two)
        embedding = _input_embedding(model)
        with tied_lookup(embedding, head.weight) if fused else own_lookup(embedding) as tied:
            packed = _packed(model, batch)
            W = batch["input_ids"].shape[1]
            keep = (packed.response_index.reshape(-1)[real] if packed is not None    # [n] or, every row's, [R]
                    else torch.arange(W - R - 1, W - 1, device=batch["input_ids"].device))
            out = _forward(model, batch, packed, _rows_of(batch, packed, keep), logits_to_keep=keep)
    finally:
        if hook is not None:
            hook.remove()
    _test_oom(batch)
    tokens = batch["responses"].reshape(-1)[real]                                 # [n]
    if fused:
        hidden = captured[0].reshape(-1, captured[0].shape[-1])                   # [n, H] packed, [B * R, H] padded
        hidden = hidden if packed is not None else hidden[real]                   # [n, H]
        grad_of = None if loss_of is None or not torch.is_grad_enabled() else \
            _grads_by_rows(loss_of, real, tokens.shape[0], (B, R), with_entropy, entropy_grad)
        logprob, entropy = head_logprobs(hidden, head.weight, tokens, temperature, *transform, with_entropy=with_entropy,
                                         grad_of=grad_of, tied=tied)
        logprob = spread(logprob, real).view(B, R)
        if with_entropy:
            entropy = spread(entropy if entropy_grad else entropy.detach(), real).view(B, R)
        if truncation is None:
            return logprob, entropy
        truncated = truncated_logprobs(hidden, head.weight, tokens, temperature, *truncation, *transform)
        return logprob, entropy, spread(truncated, real).view(B, R)
    # the model's own logits, one sequence at a time: its response tokens ([r, V]) packed, its row ([R, V]) padded
    if packed is not None:
        counts = real.view(B, R).sum(-1).tolist()
        rows = list(zip(out.logits[0].split(counts), tokens.split(counts)))

        def put(per_row):                                                         # [r] each -> [B, R]
            return spread(torch.cat(per_row), real).view(B, R)
    else:
        rows = list(zip(out.logits.view(B, R, -1), batch["responses"]))

        def put(per_row):                                                         # [R] each -> [B, R]
            return torch.stack(per_row).masked_fill(~real.view(B, R), 0.0)
    logprob = put([_token_logprobs(_scaled(z, temperature), t) for z, t in rows])
    entropy = None
    if with_entropy:
        with nullcontext() if entropy_grad else torch.no_grad():
            entropy = put([entropy_from_logits(_scaled(z, temperature)) for z, _ in rows])
    if truncation is None:
        return logprob, entropy
    with torch.no_grad():
        truncated = put([support_logprobs(_scaled(z, temperature), t, *truncation) for z, t in rows])
    return logprob, entropy, truncated


def _grads_by_rows(loss_of, real, n: int, shape: tuple[int, int], with_entropy: bool, entropy_grad: bool):
    """head_logprobs' grad_of for loss_of, a sum of per-token terms: the loss of one block of rows'
    log-probs (and entropies) in place, zeros elsewhere, differentiated; the other rows' values
    do not reach those rows' gradients. The same ops as the loss the update then builds, so the
    same numbers, which the head's backward checks. n: the head's rows (real's True places)."""
    def grad_of(start: int, stop: int, logprob, entropy):
        with torch.enable_grad():
            lp = logprob.new_zeros(n)
            lp[start:stop] = logprob
            lp.requires_grad_()
            ent = None
            if with_entropy:
                ent = logprob.new_zeros(n)
                ent[start:stop] = entropy
                ent.requires_grad_(entropy_grad)
            loss = loss_of(spread(lp, real).view(shape), None if ent is None else spread(ent, real).view(shape))
            wrt = [lp, ent] if entropy_grad else [lp]
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        return tuple(None if g is None else g[start:stop].clone() for g in grads) + (None,) * (2 - len(grads))
    return grad_of


def _head_input(model):
    """-> (head, transform, fused, captured, hook): with `fused`, the hook hands the LM head an empty
    input and keeps its real one in `captured`, for head_logprobs (see response_logprobs)."""
    head = _unwrap(model).get_output_embeddings()
    transform = getattr(_unwrap(model), "head_transform", (1.0, None))    # set by load_models
    fused = (transform is not None and type(head) is torch.nn.Linear and head.bias is None
             and not hasattr(head.weight, "ds_id"))
    captured = []
    hook = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]) or (args[0][:, :0],)) \
        if fused else None
    return head, transform, fused, captured, hook


def _sharded_logprobs(model, batch: dict, temperature: float, with_entropy: bool, entropy_grad: bool, truncation):
    """response_logprobs with the packed row split over the sequence-parallel group
    (forward/ulysses.py): each rank scores the response positions in its part of the row, and
    ulysses.combine puts the [B, R] numbers together on every rank of the group."""
    B, R = batch["responses"].shape
    packed = packing.pack(batch)
    part = ulysses.split(packed)
    index = packed.response_index.reshape(-1)                                     # [B * R] row positions
    mine = part.mine(index) & batch["attention_mask"][:, -R:].reshape(-1).bool()  # [B * R]: response tokens here
    tokens = batch["responses"].reshape(-1)[mine]                                 # [n]
    head, transform, fused, captured, hook = _head_input(model)
    try:
        with ulysses.sharded():
            out = model(**part.model_inputs(), use_cache=False, logits_to_keep=index[mine] - part.start)
    finally:
        if hook is not None:
            hook.remove()
    _test_oom(batch)
    truncated = None
    if fused:
        # n may be 0: a rank whose part of the row holds no response position scores nothing, and
        # still takes part in the combine (and the backward) with the rest of its group
        hidden = captured[0].reshape(-1, captured[0].shape[-1])                   # [n, H]
        logprob, entropy = head_logprobs(hidden, head.weight, tokens, temperature, *transform, with_entropy=with_entropy)
        if truncation is not None:
            truncated = truncated_logprobs(hidden, head.weight, tokens, temperature, *truncation, *transform)
    else:
        z = _scaled(out.logits[0], temperature)                                   # [n, V]
        logprob = _token_logprobs(z, tokens)                                      # [n]
        entropy = z.new_empty(0)
        if with_entropy:
            with nullcontext() if entropy_grad else torch.no_grad():
                entropy = entropy_from_logits(z)                                  # [n]
        if truncation is not None:
            with torch.no_grad():
                truncated = support_logprobs(z, tokens, *truncation)              # [n]
    logprob = ulysses.combine(logprob, mine).view(B, R)
    if with_entropy:
        entropy = ulysses.combine(entropy if entropy_grad else entropy.detach(), mine).view(B, R)
    else:
        entropy = None
    if truncation is None:
        return logprob, entropy
    return logprob, entropy, ulysses.combine(truncated, mine).view(B, R)


_over_limit = [0]   # the test switch's passes over its limit so far, in this process


def _test_oom(batch: dict) -> None:
    """A test switch, read here only: FLAT_PPO_TEST_OOM="RANK:N" makes the log-prob passes of the
    process with that RANK raise torch.OutOfMemoryError on a micro-batch of more than N tokens,
    right after the model's forward (past its ZeRO-3 gathers), where the LM head's [B, R, V] work
    allocates the most; "RANK:N:K": only on the K-th such pass (one OOM, at a chosen pass).
    tests/test_oom_nan_early_stop.py drives the OOM reaction with it."""
    spec = os.environ.get("FLAT_PPO_TEST_OOM")
    if spec:
        rank, limit, *nth = spec.split(":")
        tokens = int(batch["attention_mask"].sum())
        if os.environ.get("RANK", "0") == rank and tokens > int(limit):
            _over_limit[0] += 1
            if not nth or _over_limit[0] == int(nth[0]):
                raise torch.OutOfMemoryError(f"FLAT_PPO_TEST_OOM: a micro-batch of {tokens} tokens > {limit} on "
                                             f"rank {rank}")


@torch.no_grad()
def head_transform(model):
    """-> ((scale, softcap), None) when head_logprobs, fed the LM head's input with that scale and
    soft-cap, gives `model`'s own logits; (None, why) when it cannot (another post-processing, a
    head that is not a bias-free linear layer). Decided once at load on a short sequence; the
    plain path, which reads the model's own logits, serves the rest."""
    model = _unwrap(model)
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None, "its LM head is not a bias-free linear layer"
    if hasattr(head.weight, "ds_id"):   # partitioned at load (ZeRO-3 init): the plain path reads the model's own logits
        return None, None
    config = model.config.get_text_config()
    scale = float(getattr(config, "logit_scale", None) or 1.0)                      # Cohere: multiplies
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)                  # Granite: divides
    softcap = getattr(config, "final_logit_softcapping", None)                      # Gemma 2/3
    captured = []
    hook = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        ids = torch.arange(3, 11, device=head.weight.device)[None] % head.weight.shape[0]   # [1, 8]
        logits = model(input_ids=ids, use_cache=False).logits[0].float()                     # [8, V]
    finally:
        hook.remove()
    mine = captured[-1][0].float() @ head.weight.float().t() * scale                       # [8, V]
    if softcap is not None:
        mine = torch.tanh(mine / softcap) * softcap
    error = float((mine - logits).abs().max()) / max(1.0, float(logits.abs().max()))
    if error <= (1e-4 if head.weight.dtype == torch.float32 else 2e-2):
        return (scale, softcap), None
    return None, f"its forward post-processes the logits in a way the chunked head does not (difference {error:.2g})"


def _packed(model, batch: dict):
    """The micro-batch packed into one row (packing.Packed), or None to run it padded: packed when
    `model`'s attention keeps the sequences of a row apart and packing saves enough of the pass's work
    to pay (packing.worth_it; every rank runs one pass either way)."""
    inner = _unwrap(model)
    if inner.config._attn_implementation in packing.PACKED_ATTENTION and packing.worth_it(batch, packing.costs(inner)):
        return packing.pack(batch)
    return None


def _forward(model, batch: dict, packed, read=None, **kwargs):
    """model on a micro-batch: packed into one row (`packed`, from packing.pack), or padded. read: the
    flat positions whose outputs the caller reads (_rows_of): the last layer's MLP and output projection
    run on those alone (forward/last_layer.py)."""
    shape = tuple((packed.input_ids if packed is not None else batch["input_ids"]).shape)
    with last_layer.rows(_unwrap(model), read, shape):
        if packed is None:
            return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"], use_cache=False, **kwargs)
        with packing.attention():
            return model(**packed.model_inputs(), use_cache=False, **kwargs)


def _rows_of(batch: dict, packed, positions):
    """The flat positions of the model's input that the caller reads: packed, `positions` are the
    row's ([...]); padded, each sequence's own ([B, k], or [k] for every sequence alike)."""
    if packed is not None:
        return positions.reshape(-1)
    B, W = batch["input_ids"].shape
    positions = positions.expand(B, -1) if positions.dim() == 1 else positions     # [B, k]
    return (torch.arange(B, device=positions.device)[:, None] * W + positions).reshape(-1)


def _unwrap(model):
    """The Hugging Face model inside a DeepSpeed engine, a DDP wrapper or a PEFT model. (Accelerate's
    unwrap_model imports DeepSpeed, when installed, to check for its engine: about 15 MB resident in
    a run that never uses it.)"""
    while hasattr(model, "module"):
        model = model.module
    return model


def _token_logprobs(logits, tokens):
    # gather minus logsumexp (verl's form): no [R, V] log-softmax output is made
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)   # [R]


def _scaled(logits, temperature: float):
    logits = logits.float()                                                       # a no-op in fp32
    return logits if temperature == 1.0 else logits / temperature


def _input_embedding(model):
    """The model's input embedding module, or None where it names none."""
    try:
        return _unwrap(model).get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def critic_values(critic, batch: dict):
    """V(s_t) for the state before each response token -> [B, R]."""
    if ulysses.size() > 1:
        packed = packing.pack(batch)
        return _sharded_per_position(critic, packed, packed.response_index)[..., 0]       # [B, R]
    R = batch["responses"].shape[1]
    packed = _packed(critic, batch)
    W = batch["input_ids"].shape[1]
    read = packed.response_index if packed is not None else torch.arange(W - R - 1, W - 1, device=batch["input_ids"].device)
    with own_lookup(_input_embedding(critic)):   # its gradient into grad_blocks' block
        out = _forward(critic, batch, packed, _rows_of(batch, packed, read))
    if packed is not None:
        return out.logits[0, packed.response_index, 0].float()                    # [B, R]
    return out.logits[:, -R - 1:-1, 0].float()                                    # [B, R]


def reward_model_scores(reward_model, batch: dict):
    """The reward model's score of each whole sequence, read at its last real token by position
    (the attention mask), where it was trained to score -> [B]. Hugging Face's sequence
    classifiers find that token through pad_token_id instead, which with pad == EOS reads the
    token before the EOS; so the head's per-token output is taken from a hook."""
    if ulysses.size() > 1:
        packed = packing.pack(batch)
        return _sharded_per_position(reward_model, packed, packed.last_index)[..., 0]      # [B]
    head = _unwrap(reward_model).score                                            # the classifier head
    captured = []
    hook = head.register_forward_hook(lambda module, args, out: captured.append(out))
    packed = _packed(reward_model, batch)
    mask = batch["attention_mask"]
    last = packed.last_index if packed is not None else \
        (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1)      # [B]
    try:
        _forward(reward_model, batch, packed, _rows_of(batch, packed, last if packed is not None else last[:, None]))
    finally:
        hook.remove()
    per_token = captured[0][..., 0].float()                                       # [B, W] or [1, T]
    if packed is not None:
        return per_token[0, last]                                                 # [B]
    return per_token[torch.arange(mask.shape[0], device=mask.device), last]      # [B]


def _sharded_per_position(model, packed: packing.Packed, index: torch.Tensor) -> torch.Tensor:
    """A value or reward model's per-position output [1, T, k] at the row positions index [...],
    with the row split over the sequence-parallel group -> [..., k] on every rank of the group
    (each position's number from the rank holding it; see _sharded_logprobs)."""
    part = ulysses.split(packed)
    flat = index.reshape(-1)                                                      # [N]
    mine = part.mine(flat)                                                        # [N]
    with ulysses.sharded():
        out = model(**part.model_inputs(), use_cache=False).logits[0]             # [L, k]
    values = out[flat[mine] - part.start].float()                                 # [n, k]
    k = values.shape[-1]
    full = ulysses.combine(values.reshape(-1), mine[:, None].expand(-1, k).reshape(-1))   # [N * k]
    return full.view(*index.shape, k)
