"""Ulysses sequence parallelism: one packed row split along its length over a group of ranks.

The ranks of a sequence-parallel (SP) group hold the same micro-batch. Packed into one row [1, T]
(forward/packing.py), padded to a multiple of the group size n, each rank runs the model on its
own T / n positions. Everything but attention works position by position; attention goes
through DeepSpeed's ALST `UlyssesSPAttentionHF`: an all-to-all turns [T / n positions, all heads]
into [all T positions, heads / n], the packed attention runs per sequence on the whole row (the
sequence boundaries, cu_seq_lens, are the row's, and DeepSpeed gathers the position ids), and a
second all-to-all turns it back. The LM head then scores only the response positions that fall in
the rank's part, and a sum over the group puts the per-token numbers together, each computed by
exactly one rank, so they equal the unsplit pass's up to float rounding.

    ulysses.setup(2)                         # once, after the process group exists
    with ulysses.sharded():                  # no mask built; a split row's attention goes through ALST
        out = model(**part.model_inputs())   # part = ulysses.split(packed), this rank's positions

In training (train_ppo.py) the world is data-parallel x sequence-parallel: an SP group is one
data-parallel rank (data_parallel()), its ranks take the same prompts, sample a share of them each
and train on the group's rollouts put together (share(), gather(): rollout/engines.py
generate_split), and run every pass that sees whole sequences split: the actor's and
the reference's log-probs and entropy, the critic's values, the reward model's scores, the update
(forward/readouts.py). The per-token numbers are whole on every rank after combine(), so losses,
their denominators and the metrics are sp=1's. Gradients: every rank back-propagates the same loss,
and combine()'s backward sums the group's upstream gradients, so a rank's parameters get sp times
the share of its own positions; DeepSpeed (which is not told about the groups) averages over the
whole world, dp x sp ranks: sum over ranks of sp x share / (dp x sp) is the data-parallel mean of
the whole-sequence gradients, as with sp=1 (tests/test_ulysses.py checks the numbers).

DeepSpeed's own entry point, `UlyssesSPAttentionHF.register_with_transformers` (and Accelerate's
`ParallelismConfig(sp_backend="deepspeed")`, which calls it on every `prepare`), does not fit a run
with several engines: it creates the SP groups on every call (the second prepared model stops with
"sequence parallel group is already initialized") and replaces the attention function for every
model in the process for good, generation included. So the groups are made once here
(`parallel_state_sp.initialize_sequence_parallel`), and the packed attention's name dispatches to
one `UlyssesSPAttentionHF` per architecture only for a split row (its positions fewer than its
sequence boundaries cover); whole rows, padded batches and generation keep the plain attention.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from forward import packing
from forward.batch import spread

_group = None          # this rank's SP process group (DeepSpeed's parallel_state_sp)
_size = 1
_rank = 0
_leader = 0            # the global rank of the group's first member
_layers: dict = {}     # (heads, kv heads, head dim, layers) -> UlyssesSPAttentionHF


def size() -> int:
    return _size


def data_parallel(accelerator) -> tuple[int, int]:
    """(data-parallel size, this rank's data-parallel index): the world is data-parallel x
    sequence-parallel, the ranks of one SP group are consecutive and count as one data-parallel
    rank. Batch sizes, prompt shares and token budgets are per data-parallel rank, as in verl."""
    return accelerator.num_processes // _size, accelerator.process_index // _size


def leader() -> int:
    """The global rank of this rank's group's first member (sp > 1)."""
    return _leader


def share(n: int) -> tuple[int, int]:
    """[lo, hi): this rank's share of n items the group holds alike (consecutive shares in rank
    order, sizes within one; empty when n < the group's size). sp 1: all of them."""
    return n * _rank // _size, n * (_rank + 1) // _size


def gather(obj) -> list:
    """Every group member's obj, in rank order, on every rank of the group (a collective of the
    group; sp 1: [obj])."""
    if _size == 1:
        return [obj]
    parts = [None] * _size
    torch.distributed.all_gather_object(parts, obj, group=_group)   # pickled; NCCL: via the current GPU
    return parts


def from_leader(obj):
    """obj as the group's first rank has it, on every rank of the SP group (a collective of the
    group; sp 1: obj itself). The group trains on one batch, so whatever a rank draws for itself
    (a resampling) is taken from one rank, not trusted to come out the same."""
    return gather(obj)[0]


def setup(sp_size: int) -> None:
    """Make the SP groups (consecutive ranks, as DeepSpeed lays them out) and route the packed
    attention of split rows through ALST. Idempotent; sp_size 1 does nothing."""
    global _group, _size, _rank, _leader
    if sp_size == 1 or _group is not None:
        return
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    mpu.initialize_sequence_parallel(sequence_parallel_size=sp_size)
    _group, _size, _rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_world_size(), \
        mpu.get_sequence_parallel_rank()
    _leader = torch.distributed.get_rank() - _rank   # groups are consecutive ranks
    from transformers import AttentionInterface
    packing.register()
    AttentionInterface.register(packing.NAME, _attention)


# Families whose split pass fails (tests/test_ulysses.py's registry walk, transformers 5.19 and
# DeepSpeed 0.19.8: each stops with an error there, none computes wrong numbers); refused at load.
_NO_POSITIONS = "its attention layers get no position_ids, which DeepSpeed's ALST asserts it needs"
_FUSED_QKV = "its fused query/key/value projection does not fit ALST's split (a shape error in the split pass)"
UNSPLITTABLE = {
    "ctrl": _NO_POSITIONS, "gpt_bigcode": _NO_POSITIONS, "llama4_text": _NO_POSITIONS, "ministral3": _NO_POSITIONS,
    "persimmon": _NO_POSITIONS,
    "gpt2": _FUSED_QKV, "gpt-sw3": _FUSED_QKV,
    "diffllama": "its differential attention normalises over all heads, which ALST divides (a shape error)",
    "jetmoe": "its mixture of attention heads does not fit ALST's head layout (DeepSpeed rejects the key/value shapes)",
    "hrm_text": "its split pass fails with a shape error in attention (not diagnosed)",
}


def unsupported(model, sp_size: int) -> str | None:
    """Why `model` cannot run split over sp_size ranks, or None when it can."""
    config = model.config.get_text_config()
    if config.model_type in UNSPLITTABLE:
        return UNSPLITTABLE[config.model_type]
    heads = getattr(config, "num_attention_heads", None)
    if not heads:   # a recurrent or state-space model (Mamba): no attention to split the row over
        return "it has no attention heads (num_attention_heads) to split the sequence over"
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % sp_size or kv % sp_size:
        return (f"its {heads} attention heads and {kv} key-value heads must both be divisible by "
                f"ulysses_sequence_parallel_size={sp_size}")
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        # attention sinks (gpt-oss) are one logit per head, and ALST hands each rank heads/sp of them
        return "its attention sinks (one per head) are not split with the heads by ALST"
    if model.config._attn_implementation != packing.NAME:
        return (f"its attention is {model.config._attn_implementation!r}; the split rows need the packed SDPA "
                f"attention ({packing.NAME!r}, what remove_padding gives SDPA models)")
    return None


@contextmanager
def sharded():
    """The forward of a split row (Part.model_inputs()): no mask built, the packed attention
    routed through DeepSpeed's all-to-all over heads."""
    from transformers import AttentionInterface
    AttentionInterface.register(packing.NAME, _attention)   # again: loading a model re-registers packing's own
    with packing.attention():
        yield


def _attention(module, query, key, value, attention_mask, **kwargs):
    """query [b, heads, L, d]. A row's part holds fewer positions than its sequence boundaries
    cover (cu_seq_lens_q[-1] = the whole row): that goes through ALST. Decided by the inputs, not
    by being inside sharded(), because gradient checkpointing runs a layer's forward again in the
    backward pass, after sharded() has exited."""
    cu = kwargs.get("cu_seq_lens_q")
    if _size == 1 or cu is None or int(cu[-1]) == query.shape[2]:   # a whole row, or a padded batch
        return packing.packed_attention(module, query, key, value, attention_mask, **kwargs)
    return _ulysses(module.config)(module, query, key, value, None, **kwargs)


def _ulysses(config):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    key = (heads, kv, head_dim, config.num_hidden_layers)
    if key not in _layers:
        # batch 1: a packed row; variable length: every micro-batch has its own
        _layers[key] = UlyssesSPAttentionHF(packing.packed_attention, batch_size=1, attn_head_count=heads,
                                            attn_head_size=head_dim, kv_head_count=kv,
                                            num_hidden_layers=config.num_hidden_layers, process_group=_group,
                                            seq_length_is_variable=True)
    return _layers[key]


class Part:
    """This rank's positions [start, start + length) of a packed row padded to a multiple of the
    group size; the attention sees the whole padded row's sequence boundaries."""

    def __init__(self, packed: packing.Packed, sp_size: int, sp_rank: int):
        T = packed.input_ids.shape[1]
        pad = -T % sp_size
        ids, positions, cu = packed.input_ids, packed.position_ids, packed.cu_seqlens
        if pad:   # one more sequence of `pad` tokens, attending only to itself; its outputs are never read
            ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)                            # [1, T + pad]
            positions = torch.cat([positions, torch.arange(pad, device=ids.device)[None]], dim=1)
            cu = torch.cat([cu, cu.new_tensor([T + pad])])                                 # [B + 2]
        self.length = (T + pad) // sp_size
        self.start = sp_rank * self.length
        self.input_ids = ids[:, self.start:self.start + self.length]                       # [1, L]
        self.position_ids = positions[:, self.start:self.start + self.length]              # [1, L]
        self.cu_seqlens = cu

    def model_inputs(self) -> dict:
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": longest, "max_length_k": longest}

    def mine(self, index: torch.Tensor) -> torch.Tensor:
        """index [...] of row positions -> bool [...]: those this rank computes."""
        return (index >= self.start) & (index < self.start + self.length)


def split(packed: packing.Packed) -> Part:
    return Part(packed, _size, _rank)


def combine(values: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """values [n] computed where mine [N] is True -> [N] over the whole group: each position is
    one rank's, the others add zeros, so the sum is that rank's number exactly. Differentiable
    (its backward sums the gradients over the group, each rank keeping its own positions')."""
    full = spread(values, mine)                                                           # [N]
    if torch.is_grad_enabled() and full.requires_grad:
        import torch.distributed.nn.functional as dist_nn
        return dist_nn.all_reduce(full, group=_group)
    torch.distributed.all_reduce(full, group=_group)
    return full
