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


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:                                   # [1, kv, T, d] -> [1, kv * groups, T, d], as repeat_kv
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    lengths = (cu[1:] - cu[:-1]).tolist()
    # split, not slices: its backward is one concatenation, where each slice's would be a full-size zero tensor
    out = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
           for q, k, v in zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2))]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None            # [1, T, h, d]


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


def worth_it(batch: dict, min_saving: float = 0.1) -> bool:
    """Whether packing removes at least min_saving of the micro-batch's positions. Below that the
    padded layout is faster: one batched SDPA call per layer instead of one per sequence."""
    mask = batch["attention_mask"]
    return int(mask.sum()) <= (1.0 - min_saving) * mask.numel()


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
