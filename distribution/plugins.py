"""Distribution plumbing: Accelerate, with one DeepSpeed plugin (engine config) per model under
DeepSpeed, the launched DeepSpeed config checked against the values the script owns, and the
ZeRO-3 parameter gathering that generation and weight sync need. distribution/prepare.py calls
`make_accelerator` once; everything here takes plain values, never the script's config.
"""
from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from errors import UserError, first_line


@dataclass
class Role:
    """One model's part in the run, which decides its DeepSpeed engine config."""
    trained: bool                   # an optimizer and gradient clipping (else frozen, inference only)
    micro_batch: int                # sequences per forward/backward on one device
    grad_clip: float | None = None  # trained models: global-norm clipping
    offload: bool = False           # frozen models under ZeRO-3: parameters kept in CPU memory


def make_accelerator(bf16: bool, roles: dict[str, Role], owned: dict[str, tuple[str, object]]):
    """-> (accelerator, ds). Under `accelerate launch` with a DeepSpeed config, each role gets its
    own plugin derived from the launched config. owned: DeepSpeed key -> (config key, value) the
    script decides, which the launched config may only leave "auto" or match."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    # without CUDA, Accelerate would leave every rank believing it is rank 0 of 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handlers = [] if torch.cuda.is_available() or world == 1 else [InitProcessGroupKwargs(backend="gloo")]
    precision = "bf16" if bf16 else "no"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return Accelerator(mixed_precision=precision, kwargs_handlers=handlers), False
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:
        raise UserError("the accelerate config asks for DeepSpeed, which is not installed: run ./install.sh, "
                        "or launch with accelerate_configs/single.yaml / plain python")
    base = launched_deepspeed_config()
    check_deepspeed_config(base, owned, bf16)
    plugins = deepspeed_plugins(base, roles, world, bf16)
    return Accelerator(mixed_precision=precision, deepspeed_plugins=plugins, kwargs_handlers=handlers), True


def launched_deepspeed_config() -> dict:
    """The DeepSpeed config this process was launched with (the accelerate config's
    deepspeed_config_file, or its deepspeed_config keys), read through Accelerate. A missing file
    (Accelerate then reports a failed base64 decode), bad JSON or a setting of the wrong type would
    stop the run inside Accelerate or DeepSpeed with a traceback: named here in one line instead."""
    from accelerate.utils import DeepSpeedPlugin
    file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    what = "the accelerate config's deepspeed_config"
    if file != "none":
        what = f"deepspeed_config_file {file}"
        if not os.path.isfile(file):
            relative = "" if os.path.isabs(file) else f" (relative to the working directory {os.getcwd()})"
            raise UserError(f"the accelerate config's deepspeed_config_file {file} does not exist{relative}")
        try:
            with open(file, encoding="utf-8") as f:
                _check_types(json.load(f), what)
        except ValueError as e:   # JSONDecodeError and UnicodeDecodeError
            raise UserError(f"{what} is not valid JSON: {e}") from None
    try:
        conf = DeepSpeedPlugin().deepspeed_config
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"{what}: {first_line(e)}") from None
    _check_types(conf, what)
    return conf


def _check_types(conf, what: str) -> None:
    """Sections are JSON objects, and the ZeRO settings pass DeepSpeed's own validation ("auto"
    values aside: Accelerate fills them from the model later)."""
    if not isinstance(conf, dict):
        raise UserError(f"{what} must hold a JSON object of settings, got a {type(conf).__name__}")
    for section in ("zero_optimization", "bf16", "fp16"):
        if section in conf and not isinstance(conf[section], dict):
            raise UserError(f"{what}: {section} must be an object of settings, got {conf[section]!r:.40}")
    import pydantic
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    try:
        DeepSpeedZeroConfig(**{k: v for k, v in conf.get("zero_optimization", {}).items() if v != "auto"})
    except pydantic.ValidationError as e:
        problem = e.errors()[0]
        key = ".".join(str(part) for part in ("zero_optimization", *problem["loc"]))
        raise UserError(f"{what}: {key}={problem.get('input')!r:.40}: {problem['msg']}") from None


def deepspeed_plugins(base: dict, roles: dict[str, Role], world: int, bf16: bool) -> dict:
    from accelerate.utils import DeepSpeedPlugin
    plugins = {}
    saved = os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)   # YAML keys are already in `base`
    try:
        for name, role in roles.items():
            conf = copy.deepcopy(base)
            # micro-batching is ours: one engine "step" per mini-batch, our losses pre-normalised
            conf.update(train_micro_batch_size_per_gpu=role.micro_batch, gradient_accumulation_steps=1,
                        train_batch_size=role.micro_batch * world, bf16={"enabled": bf16})
            conf.pop("fp16", None)
            zero = conf.setdefault("zero_optimization", {})
            if role.trained:
                conf.update(gradient_clipping=role.grad_clip, managed_gradient_accumulation=False)
                zero["stage3_gather_16bit_weights_on_model_save"] = True
            else:
                conf.pop("gradient_clipping", None)
                zero.pop("offload_optimizer", None)
                if zero.get("stage") != 3:   # ZeRO-1/2 shard optimizer state, which a frozen model has none of
                    conf["zero_optimization"] = zero = {"stage": 0}
                if role.offload and zero.get("stage") == 3:
                    zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
            plugins[name] = DeepSpeedPlugin(hf_ds_config=conf)
    finally:
        if saved is not None:
            os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = saved
    return plugins


# the fewest elements an "auto" reduce or prefetch bucket holds (4 MiB in fp32). Accelerate fills
# "auto" with hidden_size^2, sized for large models: a model of hidden size 128 then reduces its
# gradients in 16k-element collectives, about one per weight (152 a step for the demo model), and
# collectives of small tensors cost their latency. Each element is reduced over the same ranks whatever
# the bucket (on 2 ranks bit for bit; on more, the order of the summands may follow the layout).
MIN_BUCKET = 1 << 20


def size_buckets(plugin, model) -> None:
    """The plugin's "auto" reduce and prefetch bucket sizes filled before Accelerate fills them from
    `model`: its formula (hidden_size^2, 0.9 of that), raised to MIN_BUCKET; a number in the config
    stays. The persistence threshold stays Accelerate's (10 * hidden_size): it decides which weights
    are split."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or max(getattr(config, "hidden_sizes", None) or [0])
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    for key, size in (("reduce_bucket_size", hidden * hidden), ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))):
        if zero.get(key) == "auto" and hidden:
            zero[key] = max(size, MIN_BUCKET)


def check_deepspeed_config(conf: dict, owned: dict[str, tuple[str, object]], bf16: bool) -> None:
    """A DeepSpeed JSON may leave script-owned values as "auto" or match them; anything else is a
    contradiction that would silently change the run, so it stops it."""
    for key, (cfg_key, value) in owned.items():
        if conf.get(key, "auto") not in ("auto", value):
            raise UserError(f"DeepSpeed config sets {key}={conf[key]} but {cfg_key}={value}: set it to \"auto\" "
                            f"in the JSON (the script fills it) or change {cfg_key}")
    if conf.get("gradient_accumulation_steps", "auto") not in ("auto", 1):
        raise UserError(f"DeepSpeed config sets gradient_accumulation_steps={conf['gradient_accumulation_steps']}: "
                        "set it to \"auto\"; PPO mini-batches are ppo_mini_batch_size / ppo_micro_batch_size_per_device")
    if "optimizer" in conf or "scheduler" in conf:
        raise UserError("DeepSpeed config has an optimizer/scheduler block: remove it; the script builds AdamW "
                        "from actor_lr / critic_lr and its own schedule")
    # a NaN/inf gradient must skip the step on every rank before the weights change: DeepSpeed 0.19
    # does so under ZeRO 1-3 (its overflow check runs on the reduced gradients), but not at stage 0
    # in fp32, nor in bf16 with check_grad_overflow off
    stage = conf.get("zero_optimization", {}).get("stage", 0)
    if stage == 0:
        raise UserError("DeepSpeed config has zero_optimization.stage=0, under which DeepSpeed applies an update whose "
                        "gradients are NaN/inf: use stage 1, 2 or 3, or launch without DeepSpeed "
                        "(accelerate_configs/single.yaml or plain multi-process)")
    if conf.get("bf16", {}).get("check_grad_overflow", True) is False:
        raise UserError("DeepSpeed config sets bf16.check_grad_overflow=false, under which DeepSpeed applies an update "
                        "whose gradients are NaN/inf: remove the key")
    for mp, wanted in (("fp16", False), ("bf16", bf16)):
        enabled = conf.get(mp, {}).get("enabled", "auto")
        if enabled not in ("auto", wanted):
            raise UserError(f"DeepSpeed config sets {mp}.enabled={enabled} but dtype={'bf16' if bf16 else 'fp32'}: "
                            "set it to \"auto\" or change dtype (fp32 | bf16)")


def launched_zero() -> tuple[int | None, dict[str, bool]]:
    """(ZeRO stage, {"optimizer": offloaded, "param": offloaded}) of the DeepSpeed config this
    process was launched with, read without starting anything; (None, all False) without DeepSpeed."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None, {"optimizer": False, "param": False}
    zero = launched_deepspeed_config().get("zero_optimization", {})
    return zero.get("stage", 0), {k: zero.get(f"offload_{k}", {}).get("device", "none") not in ("none", None)
                                  for k in ("optimizer", "param")}


def zero_stage(accelerator) -> int | None:
    """The ZeRO stage of the launched DeepSpeed config; None without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else plugin.zero_stage


def gathered_params(engine, ds: bool):
    """A context holding every parameter of a ZeRO-3-sharded actor on this rank for a whole
    generation, instead of gathering layer by layer for every new token (and so no collective
    runs inside generate: ranks that finish early cannot deadlock the others)."""
    if not ds or engine.zero_optimization_stage() != 3:
        return nullcontext

    @contextmanager
    def full_params():
        import deepspeed
        offload = engine.optimizer.parameter_offload
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            # ZeRO-3's per-module hooks would fetch and release (and prefetch) during generate
            offload._remove_module_hooks()
            try:
                yield
            finally:
                for p in params:
                    p.ds_active_sub_modules.clear()
                offload.setup_zero_stage3_hooks()

    return full_params


def param_share(model) -> tuple[int, int]:
    """(parameters held on this rank, parameters in the model): ZeRO-3 keeps a 1/N slice."""
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return local, total


def set_gradient_clipping(engine, max_norm: float) -> None:
    """A DeepSpeed engine's clipping norm from now on (a guard's reaction moves it): the engine
    reads its config's value at each step, ZeRO's optimizer keeps its own copy from the start."""
    engine._config.gradient_clipping = max_norm
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = max_norm
