"""Every decoder-only causal LM the pinned transformers can build, as a tiny random model.

    for model_type in families():              # walked from transformers' auto mappings, not hand-picked
        model = build(model_type)              # 2 layers, hidden 64, fp32, eval mode, in memory
        path = save_tiny(model_type, tmp)      # config, weights and a tokenizer AutoTokenizer loads

The mappings list every type with a causal-LM head; what is not a decoder-only text model
(encoder-decoder, an encoder run as a decoder, multimodal wrappers, configs that need sub-models)
lands in SKIPPED with the reason. The tiny configs keep what makes a family different and make it
bite: sliding windows of a few tokens, strong soft-caps, non-trivial logit and attention scales,
every kind of layer of an alternating family (local/global, attention/recurrent), MoE routing.
Building all of them takes seconds, so tests may walk the whole registry in the default run.
"""
from collections.abc import Mapping
import fcntl
import functools
import hashlib
import json
import os
from pathlib import Path
import tempfile

import torch

VOCAB = 256
WINDOW = 4            # sliding windows shorter than the test sequences, so a lost window shows
SOFTCAP = 2.0         # soft-caps that clip: random logits of a tiny model reach a few units

# attribute -> tiny value, applied where a family's config has the attribute
_TINY = {
    "vocab_size": VOCAB, "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embedding_size": 64,
    "intermediate_size": 96, "n_inner": 96, "ffn_dim": 96, "ffn_hidden_size": 96, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32, "dense_intermediate_size": 96,
    "expert_ffn_hidden_size": 32, "intermediate_size_mlp": 96, "moe_shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "num_key_value_heads": 2,
    "num_kv_heads": 2, "head_dim": 16, "kv_channels": 16, "attention_head_dim": 16,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "max_seq_len": 256,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "num_experts_per_token": 2, "top_k_experts": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
    "rotary_dim": 8, "n_shared_experts": 1, "expand": 1, "mamba_expand": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_headdim": 16,
    "mamba_d_state": 16, "state_size": 16, "ssm_state_size": 16, "mamba_n_groups": 1, "n_groups": 1,
    "mamba_chunk_size": 16, "chunk_size": 16, "time_step_rank": 8,
    # features that must bite
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "attention_window_size": WINDOW, "window_size": WINDOW,
    "attn_logit_softcapping": SOFTCAP, "final_logit_softcapping": SOFTCAP, "logits_soft_cap": SOFTCAP,
    "output_logit_soft_cap": SOFTCAP,
    "logit_scale": 0.5, "logits_scaling": 4.0, "attention_multiplier": 0.5, "query_pre_attn_scalar": 8,
    "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
    # hybrids whose default schedule puts attention beyond the 2 tiny layers: layer 0 recurrent, layer 1 attention
    "attn_layer_indices": [1], "attn_layer_period": 2, "attn_layer_offset": 1,
}
# hybrids whose default layer list is all recurrent (their checkpoints name the attention layers): one of each
_LAYER_KINDS = {"granitemoehybrid": {key: ["linear_attention", "full_attention"]
                                     for key in ("layer_types", "layers_block_type")}}   # one list, two names
# built with their defaults these attend to later tokens (an encoder without is_decoder, a permutation LM):
# load_models refuses them (the hf engine's sampler drew from another distribution than the one trained:
# 4e-3 and 0.5 nats from each model's own forward)
ACAUSAL = ("bert-generation", "xlnet")
_MULTIMODAL_SUBCONFIGS = ("vision_config", "audio_config", "vq_config", "audio_encoder_config")


def _causal_lm_names() -> dict:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.lru_cache(None)
def _walk() -> tuple[tuple[str, ...], dict]:
    """(buildable model types, {type: why not}) from transformers' auto mappings, walked once per
    machine for this file, this transformers and this torch: the walk builds and runs every type
    (about 6 s beyond importing their modules), and each pytest worker collecting the tests and
    each rank of a registry-walking launch asks for it. The first process to ask walks and writes
    the result to the temporary folder; the others wait for it (a file lock) and read it."""
    import transformers
    key = hashlib.sha256(Path(__file__).read_bytes() + f" {transformers.__version__} {torch.__version__}".encode())
    path = Path(tempfile.gettempdir()) / f"flat_ppo_registry_{key.hexdigest()[:16]}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            ok, skipped = json.loads(path.read_text())
            return tuple(ok), skipped
        ok, skipped = _walk_here()
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps([ok, skipped]))
        partial.rename(path)
    return ok, skipped


def _walk_here() -> tuple[tuple[str, ...], dict]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    names = _causal_lm_names()
    ok, skipped = [], {}
    for model_type, cls in sorted(names.items()):
        try:
            default = CONFIG_MAPPING[model_type]()
        except Exception as e:
            skipped[model_type] = f"its config cannot be built without sub-model configs ({type(e).__name__})"
            continue
        subs = getattr(default, "sub_configs", {}) or {}
        if getattr(default, "is_encoder_decoder", False):
            skipped[model_type] = "encoder-decoder"
        elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            skipped[model_type] = f"an encoder (masked LM) run as a decoder ({cls})"
        elif any(s in subs for s in _MULTIMODAL_SUBCONFIGS):
            text = f"{model_type}_text" if f"{model_type}_text" in names else None
            skipped[model_type] = "multimodal" + (f"; its text decoder is covered as {text}" if text else "")
        elif any(hasattr(getattr(default, s, None), "hidden_size") for s in subs if s not in _MULTIMODAL_SUBCONFIGS):
            skipped[model_type] = f"made of sub-models ({', '.join(subs)}) that a flat tiny config does not shrink"
        else:
            try:
                model = build(model_type)
            except Exception as e:
                skipped[model_type] = f"a tiny model does not build: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                continue
            try:   # its own forward on a short sequence: a tiny config some shapes do not fit is a registry gap
                with torch.no_grad():
                    model(input_ids=torch.arange(3, 12)[None], use_cache=False)
            except Exception as e:
                skipped[model_type] = f"a tiny model does not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                continue
            try:   # the conformance reference runs it with eager attention: the same shapes must fit there
                model.set_attn_implementation("eager")
                with torch.no_grad():
                    model(input_ids=torch.arange(3, 12)[None], use_cache=False)
            except Exception as e:
                skipped[model_type] = (f"a tiny model does not run with eager attention: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0][:160]}")
                continue
            ok.append(model_type)
    return tuple(ok), skipped


def families() -> list[str]:
    """Model types whose tiny causal LM builds: the decoder-only text families."""
    return list(_walk()[0])


def skipped() -> dict:
    """{model type: why it is not a family here} for every other type with a causal-LM head."""
    return dict(_walk()[1])


class _Skipped(Mapping):
    """SKIPPED as a lazily-filled mapping, so importing this module builds nothing (Mapping derives
    keys, items, values and `in` from these three)."""

    def __getitem__(self, k):
        return _walk()[1][k]

    def __iter__(self):
        return iter(_walk()[1])

    def __len__(self):
        return len(_walk()[1])

    def __repr__(self):
        return repr(_walk()[1])


SKIPPED: Mapping = _Skipped()


def _layer_kinds(values) -> list:
    """Each distinct kind once, in order of first appearance: 2+ layers keep every alternation."""
    kinds = []
    for v in values:
        if v not in kinds:
            kinds.append(v)
    return kinds


def tiny_config(model_type: str, **overrides):
    """A tiny random-model config of `model_type` with its distinguishing features made to bite;
    overrides: other tiny values (e.g. wider heads for an engine that needs them), where the config has them."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    # a property is derived from other fields (and has no setter): leave it to them
    kwargs = {k: v for k, v in {**_TINY, **overrides}.items()
              if hasattr(default, k) and not isinstance(getattr(cls, k, None), property)}
    if hasattr(default, "use_sliding_window"):      # Qwen2-style: windows only when switched on
        kwargs["use_sliding_window"] = True
        if hasattr(default, "max_window_layers"):   # layer 0 full, layer 1 sliding: the alternation bites
            kwargs["max_window_layers"] = 1
    layers = 2
    for key in ("layer_types", "layers_block_type", "mlp_layer_types", "block_types", "attention_layers"):
        values = _LAYER_KINDS.get(model_type, {}).get(key) or getattr(default, key, None)
        settable = not isinstance(getattr(type(default), key, None), property)   # some derive it from others
        if settable and isinstance(values, (list, tuple)) and values:
            kinds = _layer_kinds(values)
            layers = max(layers, len(kinds))
            kwargs[key] = kinds + [kinds[-1]] * (layers - len(kinds))
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if key in kwargs:
            kwargs[key] = layers
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):   # ids must fall inside the tiny vocabulary
        value = getattr(default, key, None)
        if isinstance(value, int) and value >= VOCAB:
            kwargs[key] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}[key]
        elif isinstance(value, list):
            kwargs[key] = [2]
    if getattr(default, "pad_token_id", None) is None and hasattr(default, "pad_token_id"):
        kwargs["pad_token_id"] = 0
    try:
        config = cls(**kwargs)
    except AttributeError:   # a layer-kind list that the config derives itself (a property without setter)
        for key in ("layer_types", "layers_block_type", "mlp_layer_types", "block_types", "attention_layers"):
            kwargs.pop(key, None)
        config = cls(**kwargs)
    for key in ("layer_types",):   # configs that derive their layer kinds from a pattern and the layer count
        values = getattr(config, key, None)
        if isinstance(values, list) and len(values) != layers:
            setattr(config, key, (values + [values[-1]] * layers)[:layers])
    config.num_labels = 1
    return config


def build(model_type: str, seed: int = 0, **overrides):
    """The tiny random causal LM of `model_type`, fp32, eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32).eval()


def tokenizer():
    """A byte-level-free word-level fast tokenizer over VOCAB ids: token i is the string f"t{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<pad>")


def save_tiny(model_type: str, directory, seed: int = 0, **overrides) -> Path:
    """The tiny model of `model_type` and a tokenizer saved in `directory` -> directory. The
    tokenizer_config names PreTrainedTokenizerFast: transformers 5 otherwise picks the tokenizer
    class from the model type and rebuilds its own pipeline over this vocabulary."""
    directory = Path(directory)
    build(model_type, seed, **overrides).save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2))
    return directory
