"""The fast log-prob paths give the model's own numbers, on every decoder family transformers builds.

For each family of tests/model_registry.py (walked from transformers' auto mappings), a tiny random
model is saved, loaded through load_models as a run loads it (remove_padding on), and
its actor and ref log-probs, entropies and gradients on a micro-batch of skewed prompt/response
lengths are compared with the model's own Hugging Face forward on each sequence alone (eager
attention, no padding), at two temperatures, packed and padded. A family the fast paths cannot
serve is refused at load (modeling/loading.py's REFUSED); the test checks the refusal is one line naming it.
"""
import time

import pytest
import torch

import model_registry
from forward import packing, readouts
from modeling import loading
from errors import UserError
from config import Config
from forward.batch import pack_batch
from forward.readouts import response_logprobs
from modeling.loading import load_models
from rollout import SamplingParams
from rollout.hf import HFEngine
from test_head_fidelity import counting_recomputes

PROMPTS = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 21, 9, 1)]
RESPONSES = [[9 + (11 * i) % 200 for i in range(n)] for n in (7, 2, 12, 1)]
TEMPERATURES = (1.0, 0.7)
TOL = dict(rtol=1e-4, atol=1e-4)


def reference(model, temperature: float, prompts=PROMPTS, responses=RESPONSES):
    """Per-sequence log-probs and entropies of the responses from the model's own forward, eager
    attention, each sequence alone -> lists of [r] tensors; the log-prob sum keeps its graph."""
    logprobs, entropies = [], []
    for prompt, response in zip(prompts, responses):
        if not response:
            continue
        ids = torch.tensor([prompt + response])                                   # [1, L]
        logits = model(input_ids=ids, use_cache=False).logits[0].float()           # [L, V]
        logits = logits[len(prompt) - 1:-1] / temperature                          # [r, V]
        log_p = torch.log_softmax(logits, dim=-1)                                  # [r, V]
        logprobs.append(log_p.gather(1, torch.tensor(response)[:, None]).squeeze(1))
        entropies.append(-(log_p.exp() * log_p).sum(-1).detach())
    return logprobs, entropies


def fast(model, temperature: float, loss_of=None, with_entropy: bool = True):
    """The same through response_logprobs on the padded micro-batch -> lists of [r] (the entropies
    None without with_entropy: the reference's pass and an update with no entropy term, whose LM
    head sums its tiles another way)."""
    batch = pack_batch(PROMPTS, RESPONSES, pad_id=0)
    logprob, entropy = response_logprobs(model, batch, temperature, with_entropy=with_entropy, loss_of=loss_of)   # [B, R]
    return ([row[:len(r)] for row, r in zip(logprob, RESPONSES) if r],
            [row[:len(r)].detach() for row, r in zip(entropy, RESPONSES) if r] if with_entropy else None)


def eager_twin(model):
    """The model's own HF forward with the same weights: eager attention, fp32."""
    twin = model_registry.build(model.config.model_type)
    twin.load_state_dict(model.state_dict())
    twin.set_attn_implementation("eager")
    return twin.eval()


def check(model, twin, temperature: float, whole_grad=None, loss_of=None):
    """whole_grad(p) -> parameter p's whole gradient (default p.grad; a split pass leaves each rank
    of its group a part: tests/ulysses_registry_worker.py sums them). loss_of: handed to
    response_logprobs, as the update does (the sum of the log-probs, which the backward runs)."""
    lp_ref, ent_ref = reference(twin, temperature)
    trained = any(p.requires_grad for p in model.parameters())
    if trained:
        twin.zero_grad(set_to_none=True)
        sum(x.sum() for x in lp_ref).backward()
    for with_entropy in (True, False):
        lp, ent = fast(model, temperature, loss_of, with_entropy)
        for a, b in zip(lp, lp_ref):
            torch.testing.assert_close(a.detach(), b.detach(), **TOL)
        for a, b in zip(ent or (), ent_ref):
            torch.testing.assert_close(a, b, **TOL)
        if not trained:
            continue
        model.zero_grad(set_to_none=True)
        sum(x.sum() for x in lp).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            grad = p.grad if whole_grad is None else whole_grad(p)
            if q.grad is None:
                assert grad is None or not grad.any(), name
                continue
            torch.testing.assert_close(grad, q.grad, rtol=1e-3, atol=1e-4,
                                       msg=lambda m: f"grad of {name} (with_entropy={with_entropy}): {m}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model type -> a directory holding its tiny model and tokenizer, saved once per module."""
    cache = {}

    def get(model_type):
        if model_type not in cache:
            cache[model_type] = model_registry.save_tiny(model_type, tmp_path_factory.mktemp(model_type))
        return cache[model_type]
    return get


# one family per feature the fast paths must honour, in the default run; the rest of the registry is marked slow
FAST = ("llama", "qwen2", "mistral", "gemma2", "gemma3_text", "cohere", "granite", "gpt_oss", "phi3", "starcoder2",
        "mamba")


@pytest.mark.parametrize("model_type", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow)
                                        for t in model_registry.families()])
def test_actor_and_ref_log_probs_match_the_models_own_forward(model_type, saved, monkeypatch):
    start = time.perf_counter()
    cfg = Config(model_path=str(saved(model_type)), adv_estimator="grpo", use_kl_in_reward=True, remove_padding=True)
    if model_type in loading.REFUSED:
        with pytest.raises(UserError) as refused:
            load_models(cfg)
        message = str(refused.value)
        assert "\n" not in message and model_type in message and loading.REFUSED[model_type] in message
        return
    if model_type in model_registry.ACAUSAL:
        with pytest.raises(UserError, match=r"^model_path: \w+ \(" + model_type + r"\) is not a causal language model: "
                                            r"changing its last token moves its outputs at earlier positions"):
            load_models(cfg)
        return
    _, actor, _, ref, _ = load_models(cfg)
    twin, ref_twin = eager_twin(actor), eager_twin(ref).requires_grad_(False)
    for layout in ("packed", "padded"):   # packing.worth_it decides between them at run time: force each
        monkeypatch.setattr(packing, "worth_it", lambda batch, *_: layout == "packed")
        for temperature in TEMPERATURES:
            check(actor, twin, temperature)
        check(ref, ref_twin, 1.0)
    print(f"{model_type}: {time.perf_counter() - start:.2f} s")


@pytest.mark.parametrize("model_type", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow)
                                        for t in model_registry.families()
                                        if t not in loading.REFUSED and t not in model_registry.ACAUSAL])
def test_checkpointed_update_gives_the_models_own_log_probs_and_gradients(model_type, saved, monkeypatch):
    """gradient_checkpointing as the update runs it (recompute_activations: every layer but the
    last recomputed, a recomputed layer's packed attention outputs reused from its first forward),
    packed: log-probs and gradients equal the model's own eager forward on each sequence alone
    (dropout stays off also in families whose layers apply it by their own training flag)."""
    from modeling.loading import recompute_activations
    cfg = Config(model_path=str(saved(model_type)), adv_estimator="grpo", use_kl_in_reward=False, remove_padding=True,
                 gradient_checkpointing=True)
    if not model_registry.build(model_type).supports_gradient_checkpointing:   # refused at load, in one line
        with pytest.raises(UserError, match=r"^gradient_checkpointing=true: \w+ does not support gradient "
                                            r"checkpointing \(transformers refuses it\); set gradient_checkpointing=false$"):
            load_models(cfg)
        return
    _, actor, _, _, _ = load_models(cfg)
    monkeypatch.setattr(packing, "worth_it", lambda batch, *_: True)
    made_again = counting_recomputes(monkeypatch)   # per row block of the chunked head
    with recompute_activations(actor, True):   # the loss handed to the head, as the update does: its gradients
        check(actor, eager_twin(actor), 1.0, loss_of=lambda logprob, entropy: logprob.sum())   # made in its forward
    _, _, chunked, _, hook = readouts._head_input(actor)
    if hook is not None:
        hook.remove()
    assert bool(made_again) == chunked and not any(made_again)   # where the head is chunked, all in the forward


@pytest.mark.parametrize("model_type", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow)
                                        for t in model_registry.families()
                                        if t not in loading.REFUSED and t not in model_registry.ACAUSAL])
def test_hf_engine_samples_from_the_models_own_distribution(model_type, saved):
    """The hf engine's decoding (left-padded rows, its in-place KV cache, grouped KV heads read in
    place, the head packed for oneDNN) against the model's own forward on each whole sequence."""
    tokenizer, actor, _, _, _ = load_models(Config(model_path=str(saved(model_type)), remove_padding=True))
    twin = eager_twin(actor).requires_grad_(False)
    engine = HFEngine(actor, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    for temperature in TEMPERATURES:
        out = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True))
        expected, _ = reference(twin, temperature, PROMPTS, out.responses)
        for drawn, own in zip(out.logprobs, expected):
            torch.testing.assert_close(torch.tensor(drawn), own, **TOL)


@pytest.mark.parametrize("model_type", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow)
                                        for t in model_registry.families()
                                        if t not in loading.REFUSED and t not in model_registry.ACAUSAL])
def test_hf_engine_in_waves_samples_what_one_call_does(model_type, saved, monkeypatch):
    """Rows that reached EOS leave the batch, their KV cache and their draws between waves of
    generate(): with waves of 3 tokens and an eighth of the vocabulary as stop tokens (rows end at
    different steps), the responses are one call's and each drawn token's reported log-prob still
    equals the model's own forward on the whole sequence."""
    import rollout.hf as hf
    tokenizer, actor, _, _, _ = load_models(Config(model_path=str(saved(model_type)), remove_padding=True))
    stops = [t for t in range(actor.get_input_embeddings().num_embeddings) if t % 8 == 3]
    runs = {}
    for wave in (3, 10**6):
        monkeypatch.setattr(hf, "WAVE", wave)
        torch.manual_seed(0)
        runs[wave] = HFEngine(actor, stops, tokenizer.pad_token_id).generate(PROMPTS, SamplingParams(max_tokens=12))
    assert runs[3].responses == runs[10**6].responses, (runs[3].responses, runs[10**6].responses)
    expected, _ = reference(eager_twin(actor).requires_grad_(False), 1.0, PROMPTS, runs[3].responses)
    for drawn, own in zip(runs[3].logprobs, expected):
        torch.testing.assert_close(torch.tensor(drawn), own, **TOL)


@pytest.mark.parametrize("model_type", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow)
                                        for t in model_registry.families()
                                        if t not in loading.REFUSED and t not in model_registry.ACAUSAL])
def test_lean_decoding_samples_from_the_models_own_distribution_where_the_model_qualifies(model_type, saved,
                                                                                       monkeypatch):
    """rollout/lean_decoding.py's step instead of generate() (and the model's forward): taken
    exactly where the model qualifies (llama and qwen2 among the default run's families), rows
    ending at stop tokens in waves of 5, and each drawn token's log-prob the model's own forward on
    the whole sequence. On llama and qwen2 also generate()'s responses, token for token (a handful
    of draws: the two paths round the logits apart by about 1e-6)."""
    import rollout.hf as hf
    from rollout import lean_decoding
    tokenizer, actor, _, _, _ = load_models(Config(model_path=str(saved(model_type)), remove_padding=True))
    stops = [t for t in range(actor.get_input_embeddings().num_embeddings) if t % 8 == 3]
    real, taken, runs = lean_decoding.decoder, [], {}
    monkeypatch.setattr(hf, "WAVE", 5)
    for lean in (True, False) if model_type in ("llama", "qwen2") else (True,):
        monkeypatch.setattr(lean_decoding, "decoder", (lambda model: taken.append(real(model)) or taken[-1])
                            if lean else (lambda model: None))
        torch.manual_seed(0)
        runs[lean] = HFEngine(actor, stops, tokenizer.pad_token_id).generate(PROMPTS, SamplingParams(max_tokens=12))
    assert (taken[0] is not None) == (lean_decoding.unfit(actor) is None)
    assert (taken[0] is not None) == (model_type in ("llama", "qwen2")) or model_type not in FAST
    assert len({len(r) for r in runs[True].responses}) > 1                      # rows ended at different steps
    expected, _ = reference(eager_twin(actor).requires_grad_(False), 1.0, PROMPTS, runs[True].responses)
    for drawn, own in zip(runs[True].logprobs, expected):
        torch.testing.assert_close(torch.tensor(drawn), own, **TOL)
    if False in runs:
        assert runs[True].responses == runs[False].responses, (runs[True].responses, runs[False].responses)


def test_lean_decoding_probe_refuses_a_model_of_the_llama_form_with_other_math(saved, monkeypatch):
    """Granite's modules have the Llama form and its multipliers (embedding, residual, attention,
    logits) change the math: the structure passes, the probe refuses it, the engine keeps
    generate(). A qualifying Llama is refused by a fresh probe once the step's rotation is bent."""
    from rollout import lean_decoding
    _, granite, _, _, _ = load_models(Config(model_path=str(saved("granite")), remove_padding=True))
    _, llama, _, _, _ = load_models(Config(model_path=str(saved("llama")), remove_padding=True))
    assert lean_decoding._structure(granite) is None
    with torch.inference_mode():
        assert lean_decoding.unfit(granite).startswith("the lean step's logits differ from its own forward's")
        assert lean_decoding.decoder(granite) is None
        assert lean_decoding.unfit(llama) is None and lean_decoding.decoder(llama) is not None
        rotated = lean_decoding._rotated
        monkeypatch.setattr(lean_decoding, "_rotated", lambda x, cos, sin: rotated(x, cos, -sin))
        delattr(llama, lean_decoding.ATTRIBUTE)   # decided again
        assert lean_decoding.unfit(llama).startswith("the lean step's logits differ from its own forward's")


def test_lean_decoding_fuses_a_norm_only_where_it_gives_the_modules_own_output(saved):
    """The step's norms: F.rms_norm where it gives the module's output bit for bit (Llama's RMSNorm),
    the module itself where the math differs (Gemma's scales by 1 + weight) or a hook is on it."""
    from rollout import lean_decoding
    _, llama, _, _, _ = load_models(Config(model_path=str(saved("llama")), remove_padding=True))
    _, gemma, _, _, _ = load_models(Config(model_path=str(saved("gemma")), remove_padding=True))
    hooked = llama.model.layers[0].post_attention_layernorm
    hooked.register_forward_hook(lambda module, args, out: None)
    with torch.inference_mode():
        for model in (llama, gemma):
            step = lean_decoding._packed_step(model)
            modules = [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
            chosen = [n for pair in step.norms for n in pair]
            x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
            for module, norm in zip(modules + [model.model.norm], chosen + [step.final_norm]):
                fused = model is llama and module is not hooked
                assert (norm is not module) == fused, (model.config.model_type, module)
                assert torch.equal(norm(x), module(x))


def test_lean_decoding_ends_a_call_when_every_row_has_drawn_a_stop_token(saved, monkeypatch):
    """Every token a stop token: each response is one token, drawn in one lean step per call."""
    from rollout import lean_decoding
    tokenizer, llama, _, _, _ = load_models(Config(model_path=str(saved("llama")), remove_padding=True))
    steps, call = [], lean_decoding.Step.__call__
    monkeypatch.setattr(lean_decoding.Step, "__call__", lambda self, *args: steps.append(1) or call(self, *args))
    stops = list(range(llama.get_input_embeddings().num_embeddings))
    out = HFEngine(llama, stops, tokenizer.pad_token_id).generate(PROMPTS, SamplingParams(max_tokens=12))
    assert [len(r) for r in out.responses] == [1] * len(PROMPTS)
    assert len(steps) == 1 + 6   # this call's one step, and the probe's six (the model's first decision)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "cohere", "granite", "gpt2"])
def test_hf_engine_packed_prefill_samples_what_the_padded_one_does(model_type, saved, monkeypatch):
    """The prompts' keys and values computed packed (rollout/hf.py's packed_prefill, one prompt of
    a single token among them) instead of by generate()'s padded prefill: the same responses, the
    same log-probs, and the packed path was the one taken."""
    import rollout.hf as hf
    tokenizer, actor, _, _, _ = load_models(Config(model_path=str(saved(model_type)), remove_padding=True))
    taken, packed_prefill = [], hf.packed_prefill
    runs = {}
    for packed in (True, False):
        monkeypatch.setattr(hf, "packed_prefill", (lambda *args: taken.append(packed_prefill(*args)) or taken[-1])
                            if packed else (lambda *args: False))
        torch.manual_seed(0)
        runs[packed] = HFEngine(actor, tokenizer.eos_token_id, tokenizer.pad_token_id).generate(
            PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    assert taken == [True]
    assert runs[True].responses == runs[False].responses
    for a, b in zip(runs[True].logprobs, runs[False].logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL)


@pytest.mark.parametrize("head", ["chunked", "model's own logits"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_positions_after_a_shorter_response_read_zero_and_the_rest_stays_exact(saved, monkeypatch, layout, head):
    """The head sees only response tokens: past each response's end the numbers are 0, on every
    path, and the response tokens' still equal the model's own forward."""
    _, actor, _, _, _ = load_models(Config(model_path=str(saved("qwen2")), remove_padding=True))
    if head != "chunked":
        actor.head_transform = None                 # what a head the chunked path cannot take gets
    monkeypatch.setattr(packing, "worth_it", lambda batch, *_: layout == "packed")
    batch = pack_batch(PROMPTS, RESPONSES, pad_id=0)
    logprob, entropy, truncated = response_logprobs(actor, batch, 0.7, with_entropy=True, truncation=(5, 0.9))
    beyond = batch["attention_mask"][:, -batch["responses"].shape[1]:] == 0      # [B, R]
    assert beyond.any()
    for x in (logprob, entropy, truncated):
        assert not x[beyond].any() and x[~beyond].ne(0).all()
    check(actor, eager_twin(actor), 0.7)


def test_a_refused_family_stops_at_load_with_one_line_naming_it(saved, monkeypatch, capsys):
    monkeypatch.setitem(loading.REFUSED, "llama", "its log-probs are not proven yet")
    with pytest.raises(UserError) as refused:
        load_models(Config(model_path=str(saved("llama")), adv_estimator="grpo"))
    assert str(refused.value) == "model_path: llama models are not supported: its log-probs are not proven yet"


def test_a_model_that_packing_would_change_runs_padded_with_one_note(saved, capsys):
    """bamba's Mamba layers carry state along the row: packed sequences would leak into each other."""
    _, actor, _, ref, _ = load_models(Config(model_path=str(saved("bamba")), adv_estimator="grpo"))
    assert actor.config._attn_implementation == ref.config._attn_implementation == "sdpa"
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: remove_padding")]
    assert len(notes) == 1 and "BambaForCausalLM runs padded micro-batches" in notes[0]


def test_critic_and_reward_model_of_a_packable_family_stay_packed(saved, tmp_path):
    """The probe compares per-position outputs: a sequence classifier pools its logits at one token."""
    from transformers import AutoModelForSequenceClassification
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(model_registry.tiny_config("qwen2")).save_pretrained(tmp_path)
    _, actor, critic, ref, reward = load_models(Config(model_path=str(saved("qwen2")), reward_model_path=str(tmp_path),
                                                       adv_estimator="gae"))
    assert [m.config._attn_implementation for m in (actor, critic, ref, reward)] == [packing.NAME] * 4


def test_the_registry_walk_finds_the_common_families_and_says_why_it_skips():
    found = set(model_registry.families())
    assert {"llama", "qwen2", "mistral", "gemma2", "gemma3_text", "phi3", "starcoder2", "cohere", "granite",
            "olmo2", "gpt_neox"} <= found
    assert model_registry.SKIPPED["bart"] == "encoder-decoder"
    assert all(reason for reason in model_registry.SKIPPED.values())
    assert not found & set(model_registry.SKIPPED)
