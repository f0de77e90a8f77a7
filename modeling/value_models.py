"""Critics and reward models for every decoder family: the family's base model plus a one-output
linear head on each position's last hidden state.

    critic = load_value_model(path, dtype)                          # any checkpoint with that backbone
    rm = load_value_model(path, dtype, head_required=True)           # refuses a checkpoint without a head
    out = model(input_ids=..., attention_mask=..., position_ids=...)  # out.logits [B, T, 1]

transformers has `...ForTokenClassification` for only a third of its causal-LM families (none for
Cohere, Granite, OLMo 2), but every family has a base model (AutoModel). So, as OpenRLHF's and
TRL's value-head models do, the class here is the family's own PreTrainedModel subclass holding
that base model under the family's prefix and a head named `score`, like Hugging Face's
classifiers. Being the family's PreTrainedModel subclass keeps from_pretrained/save_pretrained,
the family's weight init and conversions, attention selection and gradient checkpointing.

The checkpoints it loads, by their keys: a causal LM (backbone only: the head is new and starts as
a token classifier's would), a `...ForTokenClassification` or `...ForSequenceClassification`
(their `score` or `classifier` head becomes the head; a critic initialised from a reward model
starts as that reward model), a base model saved with a head (this class's own save_pretrained,
or OpenRLHF's `value_head`). The head has a bias because token classifiers have one; a checkpoint
without (sequence classifiers) gets zero, so the function is the checkpoint's.
"""
import functools

import torch

from errors import UserError

HEAD = "score"
# other names of a one-output head in checkpoints: Hugging Face token classifiers of non-generic
# families (GPT-2, GPT-NeoX, Bloom, Falcon, MPT ...) and OpenRLHF's critics and reward models
_HEAD_ALIASES = {r"^classifier\.": f"{HEAD}.", r"^value_head\.": f"{HEAD}."}


@functools.cache
def _class_for(base_model_class):
    """The value-head class of one family, made once: a subclass of the family's PreTrainedModel."""
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import TokenClassifierOutput
    family = next(c for c in base_model_class.__mro__[1:] if issubclass(c, PreTrainedModel))

    class ValueModel(family):
        # the attribute holding the base model; a family whose PreTrainedModel names none (Llama 4's is
        # "", its causal LM saves the text model as `model.`) takes its base model's own name for it
        base_model_prefix = family.base_model_prefix or base_model_class.base_model_prefix or "model"

        def __init__(self, config):
            super().__init__(config)
            setattr(self, self.base_model_prefix, base_model_class(config))
            setattr(self, HEAD, torch.nn.Linear(config.get_text_config().hidden_size, 1, bias=True))
            self.post_init()

        def get_input_embeddings(self):
            return getattr(self, self.base_model_prefix).get_input_embeddings()

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            kwargs.pop("logits_to_keep", None)   # every position is read
            out = getattr(self, self.base_model_prefix)(input_ids=input_ids, attention_mask=attention_mask,
                                                        position_ids=position_ids, **kwargs)
            # hidden states passed on: packing.unpackable probes any model through them
            return TokenClassifierOutput(logits=getattr(self, HEAD)(out.last_hidden_state),   # [B, T, 1]
                                         hidden_states=out.hidden_states)

    ValueModel.__name__ = ValueModel.__qualname__ = f"{base_model_class.__name__}WithValueHead"
    return ValueModel


def value_model_class(config):
    """The value-head class for a model config (one of transformers' families)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING
    try:
        base = MODEL_MAPPING[type(config)]
    except KeyError:
        raise UserError(f"model type {config.model_type!r} has no base model (AutoModel) in transformers to put "
                        f"a value head on") from None
    return _class_for(base)


def from_config(config):
    """An untrained model of this shape (e.g. on the meta device, for sizing)."""
    return value_model_class(config)(config)


def load_value_model(path: str, dtype, config_key: str = "critic_model_path", head_required: bool = False):
    """The value-head model from a checkpoint directory -> (model, backbone weights the checkpoint
    lacked). head_required: a reward model, whose head must come from the checkpoint (a new one
    would be random: the run would train against noise), refused in one line naming `config_key`."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    config.num_labels = 1
    model, info = value_model_class(config).from_pretrained(path, config=config, dtype=dtype, key_mapping=_HEAD_ALIASES,
                                                            output_loading_info=True)
    missing = set(info["missing_keys"])
    if head_required and f"{HEAD}.weight" in missing:
        raise UserError(f"{config_key}: {path} has no trained score head (a {_architecture(config)} checkpoint): a reward "
                        f"model must be a ...ForSequenceClassification or a base model saved with its score head; "
                        f"a new head would be random and the run would train against noise")
    if f"{HEAD}.bias" in missing and f"{HEAD}.weight" not in missing:
        _zero(getattr(model, HEAD).bias)
    backbone_missing = sorted(k for k in missing if not k.startswith(f"{HEAD}."))
    return model, backbone_missing


def _architecture(config) -> str:
    return (getattr(config, "architectures", None) or [config.model_type])[0]


@torch.no_grad()
def _zero(param):
    if hasattr(param, "ds_id"):   # loaded under ZeRO-3 init: the parameter is a shard until gathered
        import deepspeed
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.zero_()
    else:
        param.zero_()
