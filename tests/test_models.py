"""The models as the trainer loads and reads them: dropout off in every model, and a reward model
scored where it was trained to score (the last real token), in process on the committed demo model."""
from pathlib import Path

import pytest
import torch

import config
from modeling import loading
from forward.batch import pack_batch
from forward.readouts import reward_model_scores

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "examples" / "demo_model"


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_every_model_is_in_eval_mode_dropout_off(tmp_path, lora_rank):
    """PEFT's get_peft_model leaves a model in training mode (dropout on): the trainer must not rely
    on how a loader leaves it."""
    from transformers import AutoModelForSequenceClassification
    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(DEMO_MODEL, num_labels=1).save_pretrained(rm)
    cfg = config.Config(lora_rank=lora_rank, reward_model_path=str(rm))
    tokenizer, actor, critic, ref, reward_model = loading.load_models(cfg)
    for name, model in (("actor", actor), ("critic", critic), ("ref", ref), ("reward", reward_model)):
        if model is None:
            continue
        training = [n for n, m in model.named_modules() if m.training]
        assert not training, f"{name}: modules in training mode: {training[:5]}"


def test_reward_model_reads_the_last_real_token_when_pad_is_eos(tmp_path):
    """With pad == EOS, Hugging Face's sequence classifier finds the last token through pad_token_id
    and reads the one before the EOS. The trainer reads the EOS itself: the score of the sequence
    alone, unpadded, as the model was trained."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(DEMO_MODEL, num_labels=1).eval()
    model.config.pad_token_id = tok.pad_token_id
    eos = tok.eos_token_id
    prompts = [tok("12+34=", add_special_tokens=False)["input_ids"], tok("5+6=", add_special_tokens=False)["input_ids"]]
    responses = [tok("46", add_special_tokens=False)["input_ids"] + [eos], tok("1", add_special_tokens=False)["input_ids"] + [eos]]
    batch = pack_batch(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        got = reward_model_scores(model, batch)
        alone = []
        model.config.pad_token_id = None   # a single unpadded sequence: Hugging Face reads its last token
        for p, r in zip(prompts, responses):
            alone.append(model(input_ids=torch.tensor([p + r])).logits[0, 0].item())
        before_eos = [model(input_ids=torch.tensor([p + r[:-1]])).logits[0, 0].item() for p, r in zip(prompts, responses)]
    assert got.tolist() == pytest.approx(alone, abs=1e-4)
    assert all(abs(a - b) > 1e-4 for a, b in zip(alone, before_eos))   # the two readings do differ


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpointing_recomputes_all_layers_but_the_last_and_reuses_their_attention(tmp_path, dtype):
    """gradient_checkpointing on a 3-layer model, packed micro-batch: the first two layers run
    again in the backward pass, the last does not (its recompute would come first thing in the
    backward); the recomputed layers take their attention outputs from the first forward, so the
    attention kernel's forward runs once per layer and sequence; the gradients are those of no
    checkpointing. Under bf16 autocast (q, k and v of different dtypes in some families) the
    attention is recomputed, and the gradients still match at bf16's precision."""
    import shutil
    from transformers import AutoConfig, AutoModelForCausalLM
    from forward.readouts import response_logprobs
    from modeling.loading import load_models, recompute_activations
    from test_value_models import skewed_batch
    model_dir = tmp_path / "three"
    shutil.copytree(DEMO_MODEL, model_dir)
    cfg = AutoConfig.from_pretrained(DEMO_MODEL, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    _, _, batch = skewed_batch()
    batch["input_ids"] %= cfg.vocab_size
    batch["responses"] %= cfg.vocab_size
    grads, calls, kernels = {}, {}, {}
    for on in (False, True):
        cfg_run = config.Config(model_path=str(model_dir), gradient_checkpointing=on, adv_estimator="grpo",
                                use_kl_in_reward=False, dtype=dtype)
        _, actor, *_ = load_models(cfg_run)
        runs = [0, 0, 0]
        for i, layer in enumerate(actor.model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
        with torch.profiler.profile() as prof, recompute_activations(actor, on), autocast:
            logprob, _ = response_logprobs(actor, batch, 1.0)
            (logprob * batch["response_mask"]).sum().backward()
        calls[on] = runs
        kernels[on] = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu")
        grads[on] = [p.grad.clone() for p in actor.parameters()]
    assert calls == {False: [1, 1, 1], True: [2, 2, 1]}
    # layers x sequences, recompute or not (under autocast the two recomputed layers run it again)
    assert kernels[True] == kernels[False] + (2 * 4 if dtype == "bf16" else 0) == 3 * 4 + (2 * 4 if dtype == "bf16" else 0)
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_keeps_fewer_activations_in_the_update_only_with_dropout_off():
    """gradient_checkpointing: inside recompute_activations the forward pass keeps far fewer
    tensors for the backward (the decoder layers' activations are recomputed instead) and the
    gradients are the same; outside it (the no-grad passes, generation) nothing changes, and
    dropout stays off throughout."""
    from config import Config
    from forward.readouts import response_logprobs
    from modeling.loading import load_models, recompute_activations
    batch = pack_batch([[5, 6, 7], [8, 9]], [[4, 5], [6, 7, 8]], pad_id=0)
    kept, grads = {}, {}
    for on in (False, True):
        torch.manual_seed(0)
        _, actor, *_ = load_models(Config(gradient_checkpointing=on, adv_estimator="grpo", use_kl_in_reward=False))
        sizes = []

        def keep(t):
            sizes.append(t.numel() * t.element_size())
            return t
        with recompute_activations(actor, on):
            assert not any(m.training for m in actor.model.layers[0].modules() if m is not actor.model.layers[0])
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                logprob, _ = response_logprobs(actor, batch, 1.0)
            logprob.sum().backward()
        assert not any(m.training for m in actor.modules())
        kept[on] = sum(sizes)
        grads[on] = [p.grad.clone() for p in actor.parameters()]
    assert kept[True] < 0.7 * kept[False], kept
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
