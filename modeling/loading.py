"""Loading the models (actor, critic, ref, reward model) and the tokenizer, LoRA, activation
recomputation and the optimizer with its learning-rate schedule.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from config import Config, critic_checkpointing
from core_algos import lr_factor
from errors import UserError, first_line
from forward import last_layer, lean_mlp, packing, ulysses
from forward.readouts import _unwrap, head_transform
from modeling import value_models
from plumbing import console, lean_imports


# model type -> why no path here computes its log-probs right yet; load_models refuses these by name
# (tests/test_conformance.py proves every other family of the registry; README lists these)
REFUSED: dict[str, str] = {
    "rwkv": "it takes no attention mask, so its recurrent state runs through a batch's left padding (1.8 nats off "
            "on a left-padded row of its own forward; a right-padded row is exact) and through a packed row's "
            "neighbours",
    "xlstm": "its recurrent state runs through a batch's left padding (its own forward on a left-padded row is "
             "1.9 nats from the sequence alone; a right-padded row is exact)",
    "recurrent_gemma": "its log-probs match its own per-sequence forward (5e-7) but the gradients of its recurrent "
                       "block differ by up to 0.035 (linear_x.bias), padded and packed; not yet diagnosed",
    "cpmant": "its own forward on a right-padded row differs from the sequence alone by 43 nats (its attention "
              "reads the pad tokens after a sequence), and batches pad responses on the right",
    "deepseek_v4": "its compressed attention reads a batch's left padding (0.25 nats off on a left-padded row of "
                   "its own forward, even with the attention mask and positions; a right-padded row is exact)",
    "trocr": "its forward ignores position_ids (learned positions count the left padding: 0.57 nats off on a "
             "left-padded row of its own forward) and logits_to_keep",
    "hy_v4": "its own forward on a padded batch differs from each sequence alone by up to 0.009 nats, left- or "
             "right-padded (pad tokens change the other tokens' outputs)",
}


def load_models(cfg: Config):
    lean_imports.skip_unused()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = load_tokenizer(cfg.model_path, AutoTokenizer)
    # weights stay fp32 for the trained models (bf16 runs under autocast); frozen ones may be bf16
    frozen_dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    actor = _load("model_path", cfg.model_path, AutoModelForCausalLM.from_pretrained, dtype=torch.float32)
    family = actor.config.model_type
    if family in REFUSED:
        raise UserError(f"model_path: {family} models are not supported: {REFUSED[family]}")
    sees_ahead = acausal(actor, cfg.model_path)
    if sees_ahead:
        raise UserError(f"model_path: {type(actor).__name__} ({family}) is not a causal language model: {sees_ahead}; "
                        "PPO needs each token's probability given only the tokens before it")
    ends = getattr(actor.generation_config, "eos_token_id", None)
    ends = [ends] if isinstance(ends, int) else list(ends or [])
    if ends and tokenizer.eos_token_id not in ends:   # e.g. a tokenizer class's default EOS, added as a new token
        print(f"warning: model_path: responses end at the tokenizer's EOS {tokenizer.eos_token!r} (id "
              f"{tokenizer.eos_token_id}), which is not the model's (generation_config eos_token_id={ends}): set "
              f"eos_token in {cfg.model_path}/tokenizer_config.json if the model was trained to end with another",
              file=sys.stderr, flush=True)
    if cfg.lora_rank:
        actor = _with_lora(actor, cfg)
    ref = None
    if (cfg.use_kl_in_reward or cfg.use_kl_loss) and not cfg.lora_rank:
        ref = _load("ref_model_path" if cfg.ref_model_path else "model_path", cfg.ref_model_path or cfg.model_path,
                    AutoModelForCausalLM.from_pretrained, dtype=frozen_dtype)
        ref.requires_grad_(False)
    critic = None
    if cfg.adv_estimator == "gae":
        key = "critic_model_path" if cfg.critic_model_path else "model_path"
        with console.expected_missing_weights():   # the value head is new: its absence is no news
            critic, missing = _load(key, cfg.critic_model_path or cfg.model_path, value_models.load_value_model,
                                    dtype=torch.float32, config_key=key)
        if missing:
            print(f"warning: {key}: the critic's backbone lacks {len(missing)} weights, initialised at random: "
                  f"{missing[:5]}", file=sys.stderr, flush=True)
        critic.config.pad_token_id = tokenizer.pad_token_id
    reward_model = None
    if cfg.reward_model_path and cfg.reward_model_engine == "trained":   # vllm: the scorer serves it
        with console.expected_missing_weights():   # a sequence classifier's head has no bias: zero, as it scored
            reward_model, missing = _load("reward_model_path", cfg.reward_model_path, value_models.load_value_model,
                                          dtype=frozen_dtype, config_key="reward_model_path", head_required=True)
        if missing:
            raise UserError(f"reward_model_path: {cfg.reward_model_path} lacks {len(missing)} of the reward model's "
                            f"weights ({missing[:3]}); they would be random")
        reward_model.config.pad_token_id = tokenizer.pad_token_id
        reward_model.requires_grad_(False)
    for key, model in (("model_path", actor), ("critic_model_path", critic), ("ref_model_path", ref),
                       ("reward_model_path", reward_model)):
        if model is not None:
            _check_fits_model(cfg, key if getattr(cfg, key) else "model_path", model.config, len(tokenizer))
    # dropout off in every model, trained ones too (TRL's PPO does the same): PPO's ratio compares
    # two forward passes of the same weights, which dropout would make differ. Not left to the
    # loaders: PEFT's get_peft_model returns a model in training mode
    for model in (actor, critic, ref, reward_model):
        if model is not None:
            model.eval()
    if cfg.remove_padding:   # packed micro-batches: SDPA once per sequence (flash-attention packs by itself)
        verdicts = {}   # one probe per architecture: actor and ref share theirs
        for model in (actor, critic, ref, reward_model):
            if model is not None and model.config._attn_implementation == "sdpa":
                model.set_attn_implementation(packing.register())
                kind = (type(model), model.config.model_type)
                # parameters partitioned at load (ZeRO-3 init) cannot run a probe: the family's conformance test stands
                partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
                if kind not in verdicts and not partitioned:
                    verdicts[kind] = packing.unpackable(model, atol=1e-3 if model.dtype == torch.float32 else 3e-2)
                    if verdicts[kind]:
                        console.note(f"remove_padding: {type(model).__name__} runs padded micro-batches: {verdicts[kind]}")
                if verdicts.get(kind):
                    model.set_attn_implementation("sdpa")
    for model in (actor, critic, ref, reward_model):
        # Transformers' SDPA drops attention soft-capping (Gemma 2): eager keeps it where the padded path runs on SDPA
        capped = model is not None and getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
        if capped and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation("eager")
        if model is not None:   # the last layer's MLP on the rows a pass reads, where the model proves it exact
            last_layer.decide(model)
    for model in (actor, critic):   # trained: their MLPs keep the projections' outputs for the backward, not the rest
        if model is not None:
            lean_mlp.decide(model)
    if cfg.ulysses_sequence_parallel_size > 1:
        for key, model in (("model_path", actor), ("critic_model_path", critic), ("ref_model_path", ref),
                           ("reward_model_path", reward_model)):
            why = model is not None and ulysses.unsupported(model, cfg.ulysses_sequence_parallel_size)
            if why:
                raise UserError(f"ulysses_sequence_parallel_size={cfg.ulysses_sequence_parallel_size}: "
                                f"{key if getattr(cfg, key) else 'model_path'} cannot be split: {why}")
    for model in (actor, ref):
        if model is not None:
            transform, why = head_transform(model)
            _unwrap(model).head_transform = transform
            if why and model is actor:
                console.note(f"the chunked LM head is off for {type(_unwrap(model)).__name__}: {why}")
    for key, model, on in (("gradient_checkpointing", actor, cfg.gradient_checkpointing),
                           ("critic_gradient_checkpointing", critic, critic_checkpointing(cfg))):
        if model is None or not on:
            continue
        if not _unwrap(model).supports_gradient_checkpointing:
            raise UserError(f"{key}=true: {type(_unwrap(model)).__name__} does not support gradient checkpointing "
                            f"(transformers refuses it); set {key}=false")
        # armed here, active only inside recompute_activations()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                           "context_fn": packing.reuse_contexts})
    return tokenizer, actor, critic, ref, reward_model


def acausal(model, path: str = "", atol: float = 1e-5):
    """Why `model` is not causal, or None: its outputs at earlier positions must not move when a
    later token changes. An encoder built as a decoder without is_decoder (bert-generation) or a
    permutation LM (XLNet) computes each position from the whole sequence, so its "log-prob" of a
    response token reads that token, and its sampler (generation's, one token at a time) draws from
    another distribution than the one trained. Logits that come out NaN (weights that hold NaN or
    inf) raise UserError: nothing could be trained on them. Parameters partitioned at load (ZeRO-3
    init) cannot run the probe: the family's conformance test stands."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return None
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    ids = (torch.arange(3, 11, device=device) * 5 % vocab)[None]                 # [1, 8]
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    with torch.no_grad():
        before, after = (model(input_ids=x, use_cache=False).logits[0, :-1].float() for x in (ids, changed))   # [7, V]
    if before.isnan().any() or after.isnan().any():
        raise UserError(f"model_path {path}: {type(model).__name__}'s logits on an 8-token probe are NaN: its "
                        "weights hold NaN or inf values")
    moved = float(torch.where(after == before, 0.0, after - before).abs().max()) / \
        max(1.0, float(before.nan_to_num(posinf=0.0, neginf=0.0).abs().max()))   # -inf logits that stay put do not move
    return f"changing its last token moves its outputs at earlier positions (by {moved:.2g})" if moved > atol else None


@contextmanager
def recompute_activations(model, on: bool, offload: bool = False):
    """Gradient checkpointing for the length of an update. Hugging Face checkpoints a decoder layer
    only when that layer is in training mode, and every model here stays in eval mode (dropout
    off), so only the layers' own flag is raised meanwhile, and only where Hugging Face reads it:
    the layer's forward itself runs with the flag down again (_in_eval), because some families
    (OPT, BioGPT, XGLM, CTRL, GPT, GPT-NeoX-Japanese) apply dropout in the layer's own forward by
    that flag; their submodules, dropout included, stay in eval. offload (activation_offload): what
    a checkpointed layer keeps for its backward, its inputs, waits in CPU memory and goes back to
    the device when the layer is recomputed.
    Every layer but the last: the backward starts with the last layer, so its recompute would
    rebuild, first thing, the activations its forward had just let go. Kept, they add to the
    peak at most the head's work in between (the LM head's blocks, the loss), which the dry-run
    estimate counts beside one layer's full set anyway; recomputing them cost W5's 4-layer models
    a quarter of the recompute (about 28 ms of a 1.14 s actor micro-batch). The recompute of the
    others takes their packed attention's outputs from the first forward (packing.reuse_contexts,
    armed with the checkpointing at load)."""
    if not on:
        yield
        return
    layers = last_layer.decoder_layers(model)[:-1]
    saved = [layer.__dict__.get("_gradient_checkpointing_func") for layer in layers]
    forwards = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.training = True
        layer.forward = _in_eval(layer)
        if offload:
            layer._gradient_checkpointing_func = _offloaded_checkpoint
    try:   # a recomputed layer keeps nothing past its own backward: its MLPs' lean path would only add work
        with lean_mlp.paused(layers):
            yield
    finally:
        for layer, func, forward in zip(layers, saved, forwards):
            layer.training = False
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
            if offload:
                layer._gradient_checkpointing_func = func


def _in_eval(layer):
    """layer's forward run with its training flag down (the checkpoint's first forward and its recompute)."""
    forward = layer.forward

    def run(*args, **kwargs):
        was, layer.training = layer.training, False
        try:
            return forward(*args, **kwargs)
        finally:
            layer.training = was
    return run


def _offloaded_checkpoint(layer_call, *args):
    """A non-reentrant checkpoint whose retained inputs are CPU copies: the device copy is made again
    inside the layer (forward and recompute). Keyword tensors (masks, rotary tables) are shared by
    every layer and stay put. On a CPU device .to("cpu") is the tensor itself: nothing moves."""
    from torch.utils.checkpoint import checkpoint
    device = next((a.device for a in args if torch.is_tensor(a)), torch.device("cpu"))
    host = [a.to("cpu", non_blocking=True) if torch.is_tensor(a) else a for a in args]

    def on_device(*inputs):
        return layer_call(*[x.to(device, non_blocking=True) if torch.is_tensor(x) else x for x in inputs])
    return checkpoint(on_device, *host, use_reentrant=False, context_fn=packing.reuse_contexts)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(path: str, auto_tokenizer):
    """model_path's tokenizer, with a pad token (EOS when it has none). Without tokenizer files
    transformers builds an empty one from config.json's model type, which turns every prompt into
    no tokens; without EOS no response could end: both are refused here, naming the directory."""
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"model_path: {path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy "
                        "them from the model the weights come from")
    tokenizer = _load("model_path", path, auto_tokenizer.from_pretrained, "tokenizer")
    if tokenizer.eos_token_id is None:
        raise UserError(f"model_path: the tokenizer in {path} has no EOS token, so no response could end: set "
                        "eos_token in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _with_lora(actor, cfg: Config):
    """The actor wrapped in PEFT LoRA adapters. PEFT ignores a listed name that matches nothing as
    long as another one matches (a typo then trains fewer modules than asked, silently): every name
    must match a module."""
    from peft import LoraConfig, get_peft_model
    targets = cfg.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
        names = [n for n, _ in actor.named_modules()]
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in actor.named_modules() if isinstance(m, torch.nn.Linear)})
            raise UserError(f"lora_target_modules: {cfg.model_path} has no module named {', '.join(missing)}; its "
                            f"linear layers are {', '.join(linear)} (or use all-linear)")
    try:
        return get_peft_model(actor, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
                                                lora_dropout=0.0, task_type="CAUSAL_LM"))
    except Exception as e:   # PEFT raises ValueError (and its own types) for modules it cannot wrap
        raise UserError(f"lora_target_modules={cfg.lora_target_modules}: PEFT cannot add LoRA adapters to "
                        f"{cfg.model_path}: {first_line(e)}") from None


def _check_fits_model(cfg: Config, key: str, config, vocab: int) -> None:
    """A sequence (prompt + response) must fit the model's positions; vLLM refuses it naming only
    its own max_model_len, and models with learned positions fail inside the forward pass."""
    positions = getattr(config, "max_position_embeddings", None)
    length = cfg.max_prompt_length + cfg.max_response_length
    if isinstance(positions, int) and 0 < positions < length:   # -1: no limit (XLNet)
        raise UserError(f"max_prompt_length + max_response_length = {cfg.max_prompt_length} + "
                        f"{cfg.max_response_length} = {length} > max_position_embeddings={positions} of {key} "
                        f"{getattr(cfg, key)} (config.json): lower max_response_length or max_prompt_length")
    rows = getattr(config, "vocab_size", None)
    if isinstance(rows, int) and vocab > rows:
        raise UserError(f"{key}: the tokenizer of model_path has {vocab} tokens but {getattr(cfg, key)} embeds only "
                        f"vocab_size={rows} (config.json): use the tokenizer the model was trained with")


def _load(key: str, path: str, loader, what: str = "model", **kwargs):
    """A from_pretrained call whose failure names the key and the directory, in one line."""
    try:
        return loader(path, **kwargs)
    except UserError:   # already names the key and the directory
        raise
    except Exception as e:   # transformers raises OSError, ValueError, KeyError, ... for a bad directory
        raise UserError(f"{key}: cannot load a {what} from {path}: {first_line(e)}") from None


def make_optimizer(model, lr: float, cfg: Config, total_steps: int | None = None, warmup_ratio: float | None = None):
    """AdamW and its schedule, which steps once per training step; total_steps: the run's length
    (config.total_steps; default total_training_steps); warmup_ratio: this model's own (the critic's),
    default lr_warmup_steps_ratio."""
    # fused: one kernel over all tensors (on CPU about 5x faster than the per-tensor loop, same update)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=cfg.weight_decay,
                              fused=True)
    steps = cfg.total_training_steps if total_steps is None else total_steps
    ratio = cfg.lr_warmup_steps_ratio if warmup_ratio is None else warmup_ratio
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: lr_factor(
        step, cfg.lr_warmup_steps or int(ratio * steps), steps, cfg.lr_scheduler_type,
        cfg.min_lr_ratio))
    return optim, sched
