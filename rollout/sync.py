"""Weight sync: the actor's weights as (name, tensor) pairs for the rollout engine, LoRA merged in,
gathered from ZeRO-3 shards a bucket at a time.
"""
from __future__ import annotations

import typing


def weight_units(module) -> list[tuple[list, typing.Callable]]:
    """The actor's weights as the rollout engine names them, in units of (parameters, make) where
    make() -> [(Hugging Face name, tensor)] once those parameters are whole. A LoRA layer is one
    unit: its base weight with the adapter merged in (W + B A * alpha / r), named as in a model
    without adapters, which is what vLLM loads."""
    if not hasattr(module, "peft_config"):
        return [([p], lambda name=name, p=p: [(name, p.data)]) for name, p in module.named_parameters()]
    base, units = module.get_base_model(), []
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer", "")
        if name.endswith(".base_layer.weight"):
            layer = base.get_submodule(name[:-len(".base_layer.weight")])
            adapter = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
            units.append(([p, *adapter], lambda plain=plain, p=p, layer=layer: [
                (plain, p.data + layer.get_delta_weight("default").to(p.dtype))]))
        else:
            units.append(([p], lambda plain=plain, p=p: [(plain, p.data)]))
    return units


def actor_weights(actor, ds: bool, bucket_mb: float):
    """(Hugging Face name, tensor) pairs of the actor for the rollout engine (LoRA merged in).
    Under ZeRO-3 the shards are gathered a bucket of about bucket_mb at a time and released after,
    so no rank ever holds the whole model; the engine consumes the generator as it goes. Every
    rank must consume it: each bucket's gather is a collective."""
    units = weight_units(actor.module if ds else actor)
    if not ds or actor.zero_optimization_stage() != 3:
        for _, make in units:
            yield from make()
        return
    import deepspeed
    budget, bucket, size = bucket_mb * 2**20, [], 0
    for i, (params, make) in enumerate(units):
        bucket.append((params, make))
        size += sum(p.ds_numel * p.element_size() for p in params)
        if size >= budget or i == len(units) - 1:
            with deepspeed.zero.GatheredParameters([p for ps, _ in bucket for p in ps]):
                for _, make_one in bucket:
                    yield from make_one()
            bucket, size = [], 0
