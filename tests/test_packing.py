"""Packed micro-batches (packing.py) and the chunked LM-head log-probs (head_logprobs.py) give the
numbers of the padded, full-logits computation, gradients included, on prompts of very different
lengths and responses of different lengths (one empty)."""
import json

import pytest
import torch
from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification,
                          Qwen2ForTokenClassification)

from forward import packing
from forward.head_logprobs import head_logprobs
from config import Config
from core_algos import masked_mean
from forward.batch import pack_batch
from forward.readouts import critic_values, response_logprobs, reward_model_scores
from modeling.loading import load_models

VOCAB = 300
PROMPTS = [[5 + i % 50 for i in range(n)] for n in (3, 41, 17, 1)]
RESPONSES = [[60 + i for i in range(n)] for n in (6, 0, 12, 1)]


def config():
    # 4 query heads over 2 key/value heads: the grouped attention the packed path must repeat right
    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=True, pad_token_id=0, num_labels=1)


def twins(cls):
    """The same random model twice: padded SDPA and packed."""
    torch.manual_seed(0)
    padded = cls(config()).eval()
    packed = cls(config()).eval()
    packed.load_state_dict(padded.state_dict())
    packed.set_attn_implementation(packing.register())
    return padded, packed


def batch():
    return pack_batch(PROMPTS, RESPONSES, pad_id=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_ones(temperature):
    b = batch()
    mask = b["response_mask"]
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for model in twins(Qwen2ForCausalLM):
        logprob, entropy = response_logprobs(model, b, temperature, with_entropy=True, entropy_grad=True)
        loss = masked_mean(logprob * advantages, mask) + 0.1 * masked_mean(entropy, mask)
        loss.backward()
        results.append((logprob, entropy, [p.grad for p in model.parameters()]))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    real = mask.bool()
    torch.testing.assert_close(lp_b[real], lp_a[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent_b[real], ent_a[real], rtol=1e-4, atol=1e-5)
    assert torch.isfinite(lp_b).all() and torch.isfinite(ent_b).all()     # padded slots too: masks multiply them
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, rtol=1e-3, atol=1e-6)


def test_packed_values_and_reward_scores_equal_the_padded_ones():
    b = batch()
    real = b["response_mask"].bool()
    padded, packed = twins(Qwen2ForTokenClassification)
    torch.testing.assert_close(critic_values(packed, b)[real], critic_values(padded, b)[real], rtol=1e-4, atol=1e-5)
    padded, packed = twins(Qwen2ForSequenceClassification)
    torch.testing.assert_close(reward_model_scores(packed, b), reward_model_scores(padded, b), rtol=1e-4, atol=1e-5)


def test_long_sequences_of_alike_lengths_pack_on_a_small_model_and_stay_padded_on_a_large_one():
    """worth_it weighs the attention too: padded with a mask, SDPA computes the whole W^2 square of a
    row; packed, each sequence's causal half. 768-token responses after prompts of 200-241 tokens
    (2% padding): on W3's model (hidden 256, 4 layers) the attention is 40% of the work and packing
    pays; on a 7B-like one (hidden 4,096) it is a few percent and the batch stays padded."""
    def model(**shape):
        with torch.device("meta"):   # costs reads the layers' shapes alone
            return Qwen2ForCausalLM(Qwen2Config(vocab_size=32768, **shape))
    small = packing.costs(model(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2))
    large = packing.costs(model(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32))
    prompts = [[5] * n for n in (200, 213, 227, 241, 206, 219, 233, 240)]
    long = pack_batch(prompts, [[7] * 768] * 8, pad_id=0)
    assert 1 - long["attention_mask"].float().mean() < 0.1            # under the positions' 10%
    assert packing.worth_it(long, small) and not packing.worth_it(long, large)
    assert not packing.worth_it(long)                                 # positions alone: padded
    short = pack_batch([[5] * n for n in (20, 22, 25, 27, 21, 24, 26, 23)], [[7] * 16] * 8, pad_id=0)
    assert not packing.worth_it(short, small)                         # 8% padding, short: the attention is small
    alike = pack_batch([[5] * 240] * 8, [[7] * 768] * 8, pad_id=0)
    assert not packing.worth_it(alike, small)                         # no padding: SDPA's causal kernel either way


def test_pack_lays_sequences_end_to_end_and_points_at_the_response_predictors():
    b = batch()
    assert packing.worth_it(b)                                            # 131 of 212 positions are padding
    assert not packing.worth_it(pack_batch([[1, 2, 3]] * 4, [[4, 5]] * 4, pad_id=0))   # none: padded is faster
    p = packing.pack(b)
    lengths = [len(x) + len(y) for x, y in zip(PROMPTS, RESPONSES)]
    assert p.input_ids.shape == (1, sum(lengths))
    assert p.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    flat = p.input_ids[0].tolist()
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        start = p.cu_seqlens[i].item()
        assert flat[start:start + lengths[i]] == prompt + response
        assert p.position_ids[0, start:start + lengths[i]].tolist() == list(range(lengths[i]))
        for j, token in enumerate(response):   # the position before response token j predicts it
            assert flat[p.response_index[i, j] + 1] == token
        assert p.last_index[i].item() == start + lengths[i] - 1


def test_packed_attention_model_still_generates_like_sdpa_and_saves_a_plain_config(tmp_path):
    padded, packed = twins(Qwen2ForCausalLM)
    ids = torch.tensor([[0, 0, 7, 8, 9], [4, 5, 6, 7, 8]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=attention, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(packed.generate(ids, **kwargs), padded.generate(ids, **kwargs))
    packed.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert packing.NAME not in json.dumps(saved)      # the final model loads anywhere, vLLM included


@pytest.mark.parametrize("remove_padding", [True, False])
def test_load_models_packs_every_model_only_when_asked(remove_padding):
    _, actor, critic, ref, _ = load_models(Config(remove_padding=remove_padding))
    for model in (actor, critic, ref):
        assert model.config._attn_implementation == (packing.NAME if remove_padding else "sdpa")


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("with_entropy_grad", [False, True])
@pytest.mark.parametrize("cols", [16, 50])   # the vocabulary in 4 tiles (the last narrower), or whole (GPUs' chunks)
def test_head_logprobs_equals_log_softmax_in_values_and_gradients(temperature, with_entropy_grad, cols, monkeypatch):
    monkeypatch.setattr("forward.head_logprobs.TILE_ROWS", 7)            # 7 rows a block: blocks end mid-batch
    monkeypatch.setattr("forward.head_logprobs.TILE_COLS", cols)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    tokens = torch.randint(0, 50, (30,), generator=g)
    tokens[:3] = torch.tensor([49, 48, 32])   # the last tile's last and first columns, and a tile's first
    upstream = torch.randn(2, 30, generator=g)

    def loss(logprob, entropy):
        return (upstream[0] * logprob).sum() + ((upstream[1] * entropy).sum() if with_entropy_grad else 0)

    logprob, entropy = head_logprobs(hidden, weight, tokens, temperature)
    got = torch.autograd.grad(loss(logprob, entropy), (hidden, weight))
    log_p = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)              # [30, 50]
    want_lp = log_p.gather(1, tokens[:, None]).squeeze(1)
    want_ent = -(log_p.exp() * log_p).sum(-1)
    want = torch.autograd.grad(loss(want_lp, want_ent), (hidden, weight))
    torch.testing.assert_close(logprob, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_ent, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value_head", [16, 12])
def test_attention_reuse_is_kept_only_for_equal_head_sizes(value_head):
    """In a checkpointed layer's first forward the packed attention keeps each sequence's output
    for the recompute (forward/packing.py reuse_contexts), through the CPU flash kernel, which
    takes one head size for q, k and v. MLA families (DeepSeek-V2/V3) give v another; their tiny
    registry configs do not, so here by hand: such a layer runs SDPA and keeps nothing, with
    SDPA's output and gradients, where equal sizes keep one entry per sequence."""
    import types
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 8, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 8, value_head, generator=g, requires_grad=True)
    module = types.SimpleNamespace(num_key_value_groups=1, training=True)
    keep, _ = packing.reuse_contexts()
    with keep:
        store = packing._store[0]
        out, _ = packing._attention(module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5, 8]))
    assert len(store) == (2 if value_head == 16 else 0)
    expected = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                          for a, b in ((0, 5), (5, 8))], dim=2).transpose(1, 2)              # [1, T, h, d]
    torch.testing.assert_close(out, expected)
    w = torch.randn(expected.shape, generator=g)
    mine = torch.autograd.grad((out * w).sum(), (q, k, v))
    theirs = torch.autograd.grad((expected * w).sum(), (q, k, v))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
