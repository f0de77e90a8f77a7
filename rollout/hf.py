"""The hf engine: sampling with Hugging Face `generate` on the actor itself (no second copy).

Because it generates with the training weights, there is nothing to sync, sleep or wake.
"""
from __future__ import annotations

import copy
import inspect
from contextlib import ExitStack, contextmanager
from typing import Iterable

import numpy as np
import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from forward import packing
from forward.head_logprobs import head_matmul, sampling_support
from rollout import RolloutOutput, SamplingParams, Share, cut_at_eos, lean_decoding


CDF_BLOCK = 256   # vocabulary entries the Sampler's inverse CDF sums as one (inverse_cdf)
PACK_MIN_TOKENS = 8   # generate() calls this long pack their weights (_decoding_linears): the packing costs what 4-6 steps save
PACK_MIN_ELEMENTS = 1 << 17   # and their other linear layers this large (512 KB in fp32)
WAVE = 128   # tokens generate() runs before the rows that ended leave the batch (HFEngine._generate_chunk)


class HFEngine:
    name = "hf"

    def __init__(self, model, eos_token_id: int | list[int], pad_token_id: int, micro_batch_size: int = 256,
                 contexts=()):
        self.model = model                  # the unwrapped actor (an nn.Module with .generate)
        self.eos_ids = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
        self.pad_id = pad_token_id
        self.micro_batch_size = micro_batch_size
        # context-manager factories entered around each generate() call: e.g. gathering ZeRO-3
        # shards once per rollout, bf16 autocast
        self.contexts = list(contexts)

    def generate(self, prompts: list[list[int]], params: SamplingParams, share: Share | None = None) -> RolloutOutput:
        """share: which rows of a split batch these prompts are (rollout.Share). Sampling takes one
        number from torch's RNG per call, whatever the lengths drawn; each response draws from its
        own generator, seeded by that number and its place in the batch."""
        # generate() runs greedy (argmax) over what the Sampler leaves: one token per row
        gen_cfg = GenerationConfig(
            max_new_tokens=params.max_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
            eos_token_id=None if params.ignore_eos else sorted(self.eos_ids),
            pad_token_id=self.pad_id,
        )
        expanded = [p for p in prompts for _ in range(params.n)]
        keys = (share or Share.of(0, len(prompts), len(prompts))).keys(params.n)   # each row's place in the batch
        seed = params.seed if params.seed is not None else self.draw_seed(params, len(prompts))
        seed = None if params.temperature == 0 else seed   # the same on every rank of a split
        responses, logprobs = [], []
        # generate() fills unset values from model.generation_config, which would bring the
        # model's EOS back even with ignore_eos: swap it out for the duration of the call.
        saved_cfg, was_training = self.model.generation_config, self.model.training
        self.model.generation_config = gen_cfg
        self.model.eval()
        try:
            with torch.no_grad(), ExitStack() as stack:
                for make_context in self.contexts:
                    stack.enter_context(make_context())
                # inference mode inside the contexts (a ZeRO-3 gather's buffers stay normal tensors): no
                # version counters or autograd metadata on decoding's ~800 small ops a token (W5: 3-5% faster)
                stack.enter_context(torch.inference_mode())
                # decoders of the Llama form step without generate() (rollout/lean_decoding.py), their
                # layers' weights packed there; the rest keep generate() and _decoding_linears' packing
                step = lean_decoding.decoder(self.model) if params.max_tokens >= PACK_MIN_TOKENS else None
                stack.enter_context(_decoding_linears(self.model, params.max_tokens, layers=step is None))
                for i in range(0, len(expanded), self.micro_batch_size):
                    sampler = None if seed is None else Sampler(params, seed, keys[i:i + self.micro_batch_size])
                    chunk = self._generate_chunk(expanded[i:i + self.micro_batch_size], gen_cfg,
                                                 LogitsProcessorList([sampler] if sampler else []), step)
                    responses += chunk
                    if sampler is not None:
                        logprobs += [row[:len(tokens)] for row, tokens in zip(sampler.logprobs(), chunk)]
        finally:
            self.model.generation_config = saved_cfg
            self.model.train(was_training)
        # greedy has no sampling distribution to report (validation only)
        return RolloutOutput(responses=responses, logprobs=logprobs if params.temperature != 0 else None)

    def draw_seed(self, params: SamplingParams, prompts: int) -> int | None:
        """The seed one generate() call on `prompts` prompts takes when params.seed is None, the
        engine's random state moved on as after that call: a batch generated in several calls, each
        given this seed and its prompts' places (Share), samples what one call would. hf: one number
        from torch's RNG (none for greedy)."""
        return None if params.temperature == 0 else int(torch.randint(2**62, ()))

    def _generate_chunk(self, prompts: list[list[int]], gen_cfg: GenerationConfig, processors,
                        step=None) -> list[list[int]]:
        """The responses to these prompts. generate() keeps a row that reached EOS in the batch until
        the longest ends, each step paying for it (at long caches a row costs about as much as the
        weights it reads); so, where the cache can be carried over (growing_cache), generation goes
        in waves of WAVE tokens, and the rows that ended leave the batch and the cache between them.
        Each row's draws are its own (Sampler), so the waves sample what one call does. step: the
        lean decoding step (lean_decoding.decoder), which decodes instead of generate() where the
        prompts' keys and values were laid into the growing cache (packed_prefill)."""
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)      # [b, P] left-padded
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        cache = growing_cache(self.model, width + gen_cfg.max_new_tokens)          # None: generate() builds its own
        # every prompt but its last token, packed: generate() starts at the last column
        prefilled = cache is not None and packed_prefill(self.model, prompts, cache, width)
        step = step if prefilled else None
        kept = {"past_key_values": cache} if cache is not None else {}
        wave = gen_cfg.max_new_tokens if cache is None or gen_cfg.eos_token_id is None else WAVE
        alive, responses, left = list(range(len(prompts))), [[] for _ in prompts], gen_cfg.max_new_tokens
        while True:
            step_cfg = copy.copy(gen_cfg)
            step_cfg.max_new_tokens = min(wave, left)
            if step is not None:
                out = lean_decoding.generate(step, ids, mask, cache, step_cfg.max_new_tokens,
                                             processors[0] if processors else None, step_cfg.eos_token_id)
            else:   # the caller provides full weights (contexts)
                out = self.model.generate(ids, attention_mask=mask, generation_config=step_cfg,
                                          logits_processor=processors, synced_gpus=False, **kept)
            new = out[:, ids.shape[1]:]                                                # [a, <= wave]
            left -= new.shape[1]
            ended = []
            for k, row in enumerate(alive):
                tokens = new[k].tolist() if gen_cfg.eos_token_id is None else cut_at_eos(new[k].tolist(), self.eos_ids)
                responses[row] += tokens
                ended.append(len(tokens) < new.shape[1] or bool(tokens) and tokens[-1] in self.eos_ids)
            stay = [k for k, done in enumerate(ended) if not done]
            if left <= 0 or not stay:
                return responses
            mask = torch.cat([mask, mask.new_ones(new.shape)], dim=1)
            if len(stay) < len(alive):   # the rows that ended leave the batch, their cache and their draws
                pick = torch.tensor(stay, device=device)
                out, mask = out[pick], mask[pick]
                cache.batch_select_indices(pick)
                for processor in processors:
                    processor.keep(stay)
                alive = [alive[k] for k in stay]
            ids = out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        pass   # generation runs on the actor's own parameters

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}   # sampling draws from torch's RNG, which the checkpoint saves anyway

    def load_state_dict(self, state: dict) -> None:
        pass


@contextmanager
def _decoding_linears(model, steps: int, layers: bool = True):
    """A CPU model's linear layers, for one generate() call of up to `steps` tokens. Decoding
    multiplies a few rows (one per sequence) by each weight, and MKL repacks the weight at every
    call, which at these shapes costs more than the arithmetic, most of all for the LM head's
    [V, H]. For a call of at least PACK_MIN_TOKENS steps, outside autocast, each fp32 weight below
    is packed once into oneDNN's blocked layout (_packed: one pass over it, about 14 ms for
    32,768 x 256) and every step multiplies by the packed copy:
    - the LM head (a plain nn.Linear). Per step, 8 / 16 rows:
        32,768 x 256:   MKL's hidden @ W^T 6.5 / 6.2 ms, W @ hidden^T (head_matmul) 2.1 / 3.7, packed 1.2 / 1.8
        65,536 x 512:   W @ hidden^T 17 / 20, packed 7.9 (16 rows)
        151,936 x 896:  W @ hidden^T 75, packed 29 (16 rows)
    - every other plain nn.Linear whose weight is trained (its gradient, in the update, takes
      as much memory as the packed copy does here), has PACK_MIN_ELEMENTS entries or more (smaller
      ones sit in cache, where MKL is as fast), no hooks and no forward of its own already:
      768 x 256 at 16 rows 60 -> 46 us, 2,048 x 512 294 -> 182 us.
    Generation, medians of 5-8 alternating: W3's 16 rows x 64 tokens 0.96 -> 0.77 s with the head,
    -> 0.67 s with the rest; W5's 8 rows x 384 tokens 4.34 -> 3.66 -> 2.95 s; a model of 512 x
    1,536 x 50,000, 16 rows x 64 tokens 2.86 -> 2.25 -> 2.03 s.
    On this CPU a row's outputs are the same bits whatever other rows share the call (MKL's W @
    hidden^T changes them under 10 rows), and equal hidden @ W^T to fp32 rounding (1e-6 relative). The
    packed copies live for the call. layers=False: the head alone (the lean decoding step packs the
    layers its own way). A head not packed runs as head_matmul (W @ hidden^T, which
    MKL runs up to 3x faster than hidden @ W^T) on CPUs, and as it is on other devices."""
    head = model.get_output_embeddings()
    plain_head = type(head) is torch.nn.Linear and head.weight.device.type == "cpu" and "forward" not in vars(head)
    pack = steps >= PACK_MIN_TOKENS and not torch.is_autocast_enabled("cpu")
    swapped = []
    if plain_head:
        head.forward = _head_forward(head, _packed(head.weight) if pack else None)
        swapped.append(head)
    for module in model.modules() if pack and layers else ():
        if (type(module) is torch.nn.Linear and module is not head and module.weight.requires_grad
                and module.weight.device.type == "cpu" and module.weight.numel() >= PACK_MIN_ELEMENTS
                and not (module._forward_hooks or module._forward_pre_hooks or hasattr(module.weight, "ds_id")
                         or "forward" in vars(module))):   # hooked, partitioned or patched: as it is
            packed = _packed(module.weight)
            if packed is not None:
                module.forward = _linear_forward(module, packed)
                swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            del module.forward


def _packed(weight):
    """An fp32 weight [out, in] in oneDNN's blocked layout for torch.ops.mkldnn._linear_pointwise,
    or None (another dtype, a torch built without oneDNN)."""
    if weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (AttributeError, RuntimeError):
        return None


def _head_forward(head, packed):
    def forward(hidden):                                                       # [..., H]
        flat = hidden.reshape(-1, hidden.shape[-1])
        if packed is not None and flat.dtype == torch.float32:
            logits = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), packed, head.bias, "none", [], "")
        else:
            logits = head_matmul(flat, head.weight)                            # [n, V]
            if head.bias is not None:
                logits = logits + head.bias
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])              # [..., V]
    return forward


def _linear_forward(module, packed):
    def forward(x):
        if x.dtype != torch.float32:
            return torch.nn.functional.linear(x, module.weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, module.bias, "none", [], "")
    return forward


class _GrowingLayer(DynamicLayer):
    """A full-attention layer's KV cache written in place into buffers of the generation's whole
    length, its keys and values views of the filled part: Transformers' DynamicLayer concatenates
    the whole cache with each step's keys (torch.cat, O(length) a step: 20% of W5's 1,024-token
    generation). Whatever replaces the views (a crop, a batch selection) is copied into new buffers
    at the next update."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._buffers = None                                                   # (keys, values) [b, h, capacity, d]
        self._views = (None, None)                                             # what update() last returned

    def fill(self, keys, values, lengths: list[int], width: int) -> None:
        """Start the cache from keys and values [1, h, T, d] of sequences of `lengths` laid end to
        end (packed_prefill): row i holds its sequence's last lengths[i] of `width` positions, left
        padding before it at zero (masked, never attended, and no NaN to spread)."""
        self.lazy_initialization(keys, values)
        rows = len(lengths)
        self._buffers = tuple(x.new_empty(rows, x.shape[1], max(self.capacity, width), x.shape[-1]) for x in (keys, values))
        for buffer, x in zip(self._buffers, (keys, values)):
            buffer[..., :width, :].zero_()
            for row, part in zip(range(rows), x.split(lengths, dim=2)):
                buffer[row, :, width - part.shape[2]:width] = part[0]
        self._views = (self._buffers[0][..., :width, :], self._buffers[1][..., :width, :])
        self.keys, self.values = self._views

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        filled = self.get_seq_length()
        new = key_states.shape[-2]
        if self._buffers is None or self.keys is not self._views[0] or filled + new > self._buffers[0].shape[-2]:
            size = max(self.capacity, 2 * (filled + new))
            self._buffers = tuple(
                x.new_empty(*x.shape[:-2], size, x.shape[-1]) for x in (key_states, value_states))
            if filled:
                self._buffers[0][..., :filled, :] = self.keys
                self._buffers[1][..., :filled, :] = self.values
        self._buffers[0][..., filled:filled + new, :] = key_states
        self._buffers[1][..., filled:filled + new, :] = value_states
        self._views = (self._buffers[0][..., :filled + new, :], self._buffers[1][..., :filled + new, :])
        self.keys, self.values = self._views
        return self.keys, self.values


def growing_cache(model, capacity: int):
    """The DynamicCache generate() would build for `model`, with its full-attention layers as
    _GrowingLayer of `capacity` positions; None where generate() builds another kind (recurrent
    and hybrid families keep theirs, and families that cache nothing)."""
    forward = getattr(model, "get_base_model", lambda: model)().forward      # a LoRA actor: its base model's
    if (model.config.is_encoder_decoder or not model._supports_default_dynamic_cache()
            or "past_key_values" not in inspect.signature(forward).parameters):
        return None
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    if not cache.layers or any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        return None
    cache.layers = [_GrowingLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def packed_prefill(model, prompts: list[list[int]], cache, width: int) -> bool:
    """Fill `cache` (growing_cache's, every layer a _GrowingLayer) with the keys and values of every
    prompt but its last token, the prompts packed end to end in one row (forward/packing.py), for a
    left-padded batch of `width` columns: generate() then computes only the last column, and goes
    on as after its own prefill. Its own prefill runs on the padded [rows, width] batch; W3's prompts
    (22-241 tokens) are half padding there (16 prompts: 231 -> 99 ms). False, the cache untouched,
    where the model's attention does not take packed rows or no prompt has more than one token."""
    lengths = [len(p) - 1 for p in prompts]
    if (model.config._attn_implementation not in packing.PACKED_ATTENTION or max(lengths) < 1
            or any(type(layer) is not _GrowingLayer for layer in cache.layers)):
        return False
    device = next(model.parameters()).device
    longest = max(lengths)
    ends = torch.tensor([0] + lengths, device=device).cumsum(0)
    inputs = {"input_ids": torch.tensor([t for p in prompts for t in p[:-1]], device=device)[None],      # [1, T]
              "position_ids": torch.cat([torch.arange(n, device=device) for n in lengths])[None],        # [1, T]
              "attention_mask": None, "max_length_q": longest, "max_length_k": longest,
              # an empty sequence (a one-token prompt) is left out of the boundaries: nothing attends there
              "cu_seq_lens_q": torch.unique_consecutive(ends).to(torch.int32)}
    inputs["cu_seq_lens_k"] = inputs["cu_seq_lens_q"]
    prefix = DynamicCache(config=model.config.get_text_config(decoder=True))
    with packing.attention():
        model(**inputs, past_key_values=prefix, use_cache=True, logits_to_keep=1)
    if len(prefix.layers) != len(cache.layers):
        raise RuntimeError(f"packed_prefill: {len(prefix.layers)} cached layers, the generation cache has "
                           f"{len(cache.layers)}")
    for layer, made in zip(cache.layers, prefix.layers):
        layer.fill(made.keys, made.values, lengths, width - 1)
    return True


def inverse_cdf(weights, u):
    """Where each row's running sum of weights [b, V] (>= 0, fp32, V a multiple of CDF_BLOCK) first
    exceeds the fraction u [b, 1] of its total: the token that u draws from the distribution
    proportional to the weights, in two levels: the running sum of the blocks' totals finds the
    block, the running sum within it the token, both summed in float64 (each block's total is an
    fp32 sum, exact to fp32 rounding like the weights themselves). A float64 running sum over the
    whole row, as before, converted all of a 32k vocabulary to float64 at each step: most of the
    sampler's time. A token of zero weight is never drawn: searchsorted(right=True) steps over
    flat stretches, and the block and the token are held to the last ones with weight where
    rounding puts u past them. -> (token [b, 1], total [b, 1] float64)."""
    b = weights.shape[0]
    blocks = weights.view(b, -1, CDF_BLOCK)                                              # [b, n, B]
    ends = blocks.sum(-1).double().cumsum_(-1)                                           # [b, n] the running sum at each block's end
    total = ends[:, -1:].contiguous()
    u = u * total
    block = torch.minimum(torch.searchsorted(ends, u, right=True), torch.searchsorted(ends, total))       # [b, 1]
    block.clamp_(max=ends.shape[-1] - 1)                                                 # (rows of NaN: no total to hold to)
    before = torch.where(block > 0, ends.gather(-1, (block - 1).clamp(min=0)), 0.0)     # the running sum where it starts
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK)).squeeze(1)    # [b, B]
    inside = inside.cumsum(-1, dtype=torch.float64)
    at = torch.minimum(torch.searchsorted(inside, u - before, right=True),
                       torch.searchsorted(inside, inside[:, -1:].contiguous())).clamp_(max=CDF_BLOCK - 1)
    return block * CDF_BLOCK + at, total


class Sampler(LogitsProcessor):
    """Draws the next token from softmax(logits / temperature), cut to top_k and top_p when set
    (head_logprobs.sampling_support: vLLM's rules, so both engines sample the same distribution),
    and leaves only it: generate()'s argmax then picks it. One uniform number per row through
    the inverse CDF (exponentials in fp32, their running sums in float64: inverse_cdf), where
    torch.multinomial, which generate() samples with, draws an exponential number for every
    vocabulary entry: with a 32k vocabulary that was 40% of the generation time on a CPU. The
    same distribution either way (up to fp32 rounding). Row k's numbers come from its own
    generator, seeded with (seed, keys[k]): a response's draws depend on the call's seed and its
    place in the batch, not on which rows share its call (micro-batches, a split over ranks). The
    seed comes from torch's RNG (by default), so a checkpoint's saved RNG state replays it.
    (Transformers' own sampling also adds a top_k of 50 when top_k is unset; here unset means the
    whole vocabulary, as in vLLM.)
    It keeps the log-prob of each drawn token under the distribution it was drawn from
    (renormalised over the kept tokens, as vLLM's processed_logprobs): logprobs() -> [b, steps]."""

    def __init__(self, params: SamplingParams, seed: int | None = None, keys: list[int] | None = None):
        self.temperature, self.top_p, self.top_k = params.temperature, params.top_p, params.top_k
        self.seed = int(torch.randint(2**62, ())) if seed is None else seed
        self.keys = keys                                                           # None: rows 0, 1, ...
        self._rows: list[np.random.Generator] = []                                # one per row, made at the first step
        self._alive: list[int] = []                                                # the rows still in the batch
        self._drawn: list[list[float]] = []                                        # per row, a log-prob per step

    def __call__(self, input_ids, scores):
        """The drawn token's column 0 and every other -inf: generate()'s argmax takes it."""
        z, token = self.draw(scores)
        return z[:, :scores.shape[1]].fill_(float("-inf")).scatter_(-1, token, 0.0)

    def draw(self, scores):
        """Each row's next token -> (the buffer the draw used, [b, V'], free to overwrite; token [b, 1])."""
        b, vocab = scores.shape
        # a head not packed gives head_matmul's logits, a transposed view: each row's reductions run
        # 5-50x faster on a contiguous copy (one pass) than along the view's strided rows; the copy
        # is as wide as whole CDF_BLOCKs, the entries past the vocabulary of zero weight
        z = scores.new_empty(b, -(-vocab // CDF_BLOCK) * CDF_BLOCK, dtype=torch.float32)   # [b, V']
        z[:, vocab:] = float("-inf")
        logits = z[:, :vocab].copy_(scores)                                            # fp32 whatever the scores' dtype
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        if self.top_p < 1.0 or 0 < self.top_k < vocab:
            logits.masked_fill_(~sampling_support(logits, self.top_k, self.top_p), float("-inf"))
        weights = z.sub_(z.amax(-1, keepdim=True)).exp_()                             # [b, V'] fp32, 0 where cut
        if not self._rows:
            keys = self.keys if self.keys is not None else range(b)
            self._rows = [np.random.default_rng([self.seed, key]) for key in keys]
            self._alive, self._drawn = list(range(len(self._rows))), [[] for _ in self._rows]
        u = torch.tensor([[g.random()] for g in self._rows], dtype=torch.float64).to(z.device)
        token, total = inverse_cdf(weights, u)                                       # [b, 1] each
        token.clamp_(max=vocab - 1)                                                 # (rows of NaN)
        drawn = (weights.gather(-1, token).double() / total).log().squeeze(-1)       # [b] kept, renormalised
        for row, logprob in zip(self._alive, drawn.float().tolist()):
            self._drawn[row].append(logprob)
        return weights, token

    def keep(self, stay: list[int]) -> None:
        """Only the batch's rows `stay` go on (the others ended): their generators go on drawing."""
        self._rows, self._alive = [self._rows[k] for k in stay], [self._alive[k] for k in stay]

    def logprobs(self) -> list[list[float]]:
        """Each row's log-prob of every token it drew, the rows in the order of the first call."""
        return self._drawn
