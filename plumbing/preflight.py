"""Preflight (`python train_ppo.py --config X.yaml --dry_run`): what the run will need in memory,
per rank, read from the model configs alone (no weights load), against what the machine has; what
does not fit and which key to change. train_ppo.py builds a `Plan` from its config and calls
`report(plan)` in one line; nothing here reads the script's config.

The figures are estimates of the largest terms, stated per component so they can be checked:
- model states, per parameter: fp32 training keeps 4 bytes of weights, 4 of gradients and 8 of
  AdamW moments; DeepSpeed bf16 keeps 2 + 2 and 12 (fp32 master weights and moments). ZeRO-1
  shards the optimizer states over the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too
  (plus one gathered layer at a time); offload moves the sharded parts to host memory.
- frozen models (reference, reward model): their weights (bf16 when dtype=bf16), sharded under ZeRO-3.
- activations of one training micro-batch of full-length sequences (max_prompt_length +
  max_response_length) kept for the backward pass, per decoder layer and token: about
  6 x hidden + 2 x kv width + 4 x intermediate values (2 x intermediate in fp32 without ZeRO-3, where
  a gated MLP keeps only its gate and up projections' outputs: forward/lean_mlp.py), plus on CPU
  2 x heads x length attention scores (PyTorch's CPU attention keeps them; the GPU's fused kernels
  do not); with gradient checkpointing only each layer's input, plus
  one layer's full set (and on CPU each checkpointed layer's attention output, which the
  recompute reuses). The logits of a micro-batch (response positions only x vocabulary, fp32)
  three times over: the logits, the softmax's workspace, their gradient. With Ulysses sequence
  parallelism (ulysses_sequence_parallel_size = sp) each rank holds 1/sp of every sequence's
  positions, and its attention all heads / sp over the whole sequence: activations and logits / sp.
- generation: the hf engine's KV cache, and under ZeRO-3 the whole actor it gathers on every rank
  for the rollout (its full weights, not a shard); vLLM's share (gpu_memory_utilization of the GPU, or its
  weights plus rollout_kv_cache_gb on CPU), which on a GPU coexists with the model states during
  generation (sleep mode only frees it while the models train).
- the LLM judge (reward_judge_path): the hf engine's frozen copy and its KV cache while scoring, or
  its vLLM engine's share (reward_judge_gpu_memory_utilization; on CPU its weights plus
  reward_judge_kv_cache_gb); a reward model on vLLM (reward_model_engine=vllm) likewise; scoring
  runs between generation and the update, so it peaks alone.
- the process itself: on CPU, the resident memory of the libraries once imported (measured now);
  on GPU, about 1 GiB of CUDA context.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

GiB = 2**30


@dataclass
class ModelShape:
    params: int            # all parameters (tied ones once)
    trainable: int         # what the optimizer holds (LoRA: the adapters)
    largest: int           # the largest single tensor (ZeRO-3 gathers it whole)
    hidden: int
    layers: int
    heads: int
    kv_width: int          # key/value projection width (kv heads x head dim)
    intermediate: int
    vocab: int
    kv_heads: int = 0      # key/value heads (0: as many as attention heads)


@dataclass
class Plan:
    actor: ModelShape
    critic: ModelShape | None
    ref: ModelShape | None
    reward: ModelShape | None
    worlds: list[int]                 # the world sizes to estimate for (the launched one first)
    zero_stage: int | None            # None = no DeepSpeed (every rank holds whole models)
    offload_optimizer: bool
    offload_params: bool
    ref_offload: bool
    reward_offload: bool
    bf16: bool
    micro_batch: int                  # actor sequences per forward/backward on one device
    critic_micro_batch: int
    seq_len: int                      # max_prompt_length + max_response_length
    response_len: int                 # max_response_length: only these positions reach the LM head
    gen_batch: int                    # hf engine: sequences per generate() call
    gradient_checkpointing: bool
    critic_gradient_checkpointing: bool
    engine: str                       # hf | vllm
    gpu_memory_utilization: float
    kv_cache_gb: float
    gpu_bytes: int | None             # device memory of one GPU; None on CPU
    host_bytes: int                   # host memory of this machine
    local_ranks: int                  # ranks sharing this machine (and, on CPU, its memory)
    baseline_bytes: int               # the process before any model loads
    notes: list[str] = field(default_factory=list)
    sp: int = 1                       # ulysses_sequence_parallel_size: ranks sharing each sequence
    judge: ModelShape | None = None   # the LLM judge (reward_judge_path)
    judge_engine: str = "hf"          # hf | vllm
    judge_gpu_memory_utilization: float = 0.0
    judge_kv_cache_gb: float = 0.0
    judge_seq_len: int = 0            # reward_judge_prompt_length + reward_judge_max_tokens
    served_reward: bool = False       # reward_model_engine=vllm: `reward` runs on a vLLM engine of its own
    served_gpu_memory_utilization: float = 0.0
    served_kv_cache_gb: float = 0.0


def model_shape(path: str, kind: str, lora_rank: int = 0, lora_targets: str = "all-linear") -> ModelShape:
    """A model's sizes from its config.json alone: the model is built on the meta device."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from modeling import value_models
    config = AutoConfig.from_pretrained(path)
    if kind != "causal":   # critic and reward model: the backbone and a one-output head
        config.num_labels = 1
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config) if kind == "causal" else value_models.from_config(config)
    model.tie_weights()   # tied embeddings are one tensor, as after from_pretrained
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    trainable = total
    if lora_rank:
        names = None if lora_targets == "all-linear" else {t.strip() for t in lora_targets.split(",")}
        trainable = sum(lora_rank * (m.in_features + m.out_features) for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
                        and (names is None or n.rsplit(".", 1)[-1] in names))
    text = getattr(config, "text_config", config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(total, trainable, max(p.numel() for p in params.values()), text.hidden_size,
                      text.num_hidden_layers, heads, getattr(text, "num_key_value_heads", heads) * head_dim,
                      getattr(text, "intermediate_size", 4 * text.hidden_size), text.vocab_size,
                      getattr(text, "num_key_value_heads", None) or heads)


def rows_for(plan: Plan, world: int) -> list[tuple[str, float, str]]:
    """(what, bytes per rank, where: device | host) for one world size."""
    z = plan.zero_stage or 0
    shard = lambda n, stage: n / world if z >= stage else n                   # noqa: E731
    weight_b, grad_b, optim_b = (2, 2, 12) if plan.bf16 and plan.zero_stage is not None else (4, 4, 8)
    frozen_b = 2 if plan.bf16 else 4
    device = "device"
    rows = []
    for name, m in (("actor", plan.actor), ("critic", plan.critic)):
        if m is None:
            continue
        off_p = plan.offload_params and z == 3
        rows.append((f"{name} weights", shard(m.params * weight_b, 3), "host" if off_p else device))
        rows.append((f"{name} gradients", shard(m.trainable * grad_b, 2), device))
        rows.append((f"{name} optimizer states", shard(m.trainable * optim_b, 1),
                     "host" if plan.offload_optimizer and z >= 1 else device))
        if z == 3:
            rows.append((f"{name} ZeRO-3 gathered layer", m.largest * weight_b, device))
    for name, m, off in (("reference", plan.ref, plan.ref_offload), ("reward model", plan.reward, plan.reward_offload)):
        if m is not None and not (name == "reward model" and plan.served_reward):
            rows.append((f"{name} weights", shard(m.params * frozen_b, 3), "host" if off and z == 3 else device))
    act_b = 2 if plan.bf16 else 4
    split = " per rank of a sequence-parallel group" if plan.sp > 1 else ""
    for name, m, micro, ckpt_on in (("actor", plan.actor, plan.micro_batch, plan.gradient_checkpointing),
                                    ("critic", plan.critic, plan.critic_micro_batch, plan.critic_gradient_checkpointing)):
        if m is None:
            continue
        tokens = micro * plan.seq_len
        scores = 0 if plan.gpu_bytes else 2 * m.heads * plan.seq_len
        mlp = 2 if not plan.bf16 and z != 3 else 4   # lean_mlp: fp32 (no autocast), weights not partitioned
        per_layer = tokens * (6 * m.hidden + 2 * m.kv_width + mlp * m.intermediate + scores) * act_b
        full = per_layer * m.layers
        ckpt = tokens * m.hidden * act_b * m.layers + per_layer
        if not plan.gpu_bytes:   # on CPU the checkpointed layers' packed attention outputs wait for the recompute too
            ckpt += tokens * (m.hidden * act_b + 4 * m.heads) * (m.layers - 1)
        full, ckpt = full / plan.sp, ckpt / plan.sp   # each rank: 1/sp of the positions (all heads / sp of them)
        rows.append((f"{name} activations, one micro-batch" + (" (checkpointed)" if ckpt_on else "") + split,
                     ckpt if ckpt_on else full, device))
        if not ckpt_on:
            rows.append((f"  (with gradient_checkpointing: {ckpt / GiB:.2f} GiB)", 0.0, device))
        if name == "actor":
            rows.append(("actor logits, one micro-batch" + split,
                         3 * micro * (plan.response_len + 1) * m.vocab * 4 / plan.sp, device))
    a = plan.actor
    if plan.engine == "hf":
        kv = 2 * plan.gen_batch * plan.seq_len * a.layers * a.kv_width * act_b
        rows.append(("generation KV cache (hf engine)", kv, device))
        if z == 3:   # generate() runs on the whole actor, gathered on every rank for the rollout
            rows.append(("generation: gathered full actor (hf engine, ZeRO-3)", a.params * weight_b, device))
    elif plan.gpu_bytes:
        rows.append(("vLLM (rollout_gpu_memory_utilization, during generation)",
                     plan.gpu_memory_utilization * plan.gpu_bytes, device))
    else:
        rows.append(("vLLM weights + rollout_kv_cache_gb", a.params * (2 if plan.bf16 else 4) + plan.kv_cache_gb * GiB,
                     device))
    rows += judge_rows(plan)
    rows.append(("CUDA context" if plan.gpu_bytes else "libraries (this process, measured)",
                 1 * GiB if plan.gpu_bytes else plan.baseline_bytes, device))
    return rows


def judge_rows(plan: Plan) -> list[tuple[str, float, str]]:
    """The LLM judge: the hf engine's frozen copy stays resident and its KV cache exists while it
    scores; a vLLM judge holds its share (GPU) or its weights and KV cache (CPU). Scoring runs
    while the rollout engine sleeps and no activations are kept, so it peaks on its own."""
    weight_b = 2 if plan.bf16 else 4
    if plan.served_reward and plan.reward is not None:
        return [("served reward model: vLLM (reward_model_gpu_memory_utilization, while scoring)",
                 plan.served_gpu_memory_utilization * plan.gpu_bytes, "device")] if plan.gpu_bytes else \
               [("served reward model: vLLM weights + reward_model_kv_cache_gb",
                 plan.reward.params * weight_b + plan.served_kv_cache_gb * GiB, "device")]
    j = plan.judge
    if j is None:
        return []
    if plan.judge_engine == "hf":
        return [("judge weights (hf engine)", j.params * weight_b, "device"),
                ("judge: KV cache while scoring (hf engine)",
                 2 * plan.gen_batch * plan.judge_seq_len * j.layers * j.kv_width * weight_b, "device")]
    if plan.gpu_bytes:
        return [("judge: vLLM (reward_judge_gpu_memory_utilization, while scoring)",
                 plan.judge_gpu_memory_utilization * plan.gpu_bytes, "device")]
    return [("judge: vLLM weights + reward_judge_kv_cache_gb", j.params * weight_b + plan.judge_kv_cache_gb * GiB,
             "device")]


def need(rows) -> tuple[float, float]:
    """(device bytes, host bytes) at the peak: everything resident, plus the larger of the update's
    activations and generation (they do not coexist)."""
    def is_act(what):
        return "activations" in what or "logits" in what
    def is_judging(what):   # scoring on an engine of its own: while the rollout engine sleeps
        return what.startswith(("judge:", "served reward model:"))

    def is_gen(what):
        return not is_judging(what) and ("KV cache" in what or "vLLM" in what or what.startswith("generation"))
    base = {"device": 0.0, "host": 0.0}
    for what, b, where in rows:
        if not is_act(what) and not is_gen(what) and not is_judging(what):
            base[where] += b
    act = max([sum(b for w, b, _ in rows if is_act(w) and w.startswith(who)) for who in ("actor", "critic")] + [0])
    gen = sum(b for w, b, _ in rows if is_gen(w))
    judging = sum(b for w, b, _ in rows if is_judging(w))
    return base["device"] + max(act, gen, judging), base["host"]


def report(plan: Plan) -> bool:
    """Print the per-rank table for each world size in plan.worlds and the verdict for the first
    (the launched one) -> whether it fits."""
    tables = {w: rows_for(plan, w) for w in plan.worlds}
    names = [what for what, _, _ in tables[plan.worlds[0]]]
    zero = "no DeepSpeed" if plan.zero_stage is None else f"ZeRO-{plan.zero_stage}" + (
        ", optimizer offload" if plan.offload_optimizer else "") + (", parameter offload" if plan.offload_params else "")
    split = f", each split over {plan.sp} ranks (ulysses_sequence_parallel_size)" if plan.sp > 1 else ""
    print(f"memory per rank, GiB ({zero}; {'bf16' if plan.bf16 else 'fp32'}; sequences of {plan.seq_len} tokens{split})")
    width = max(len(n) for n in names) + 2
    print(" " * width + "".join(f"{f'{w} rank' + ('s' if w > 1 else ''):>12}" for w in plan.worlds))
    for i, name in enumerate(names):
        cells = "".join(f"{tables[w][i][1] / GiB:12.2f}" if tables[w][i][1] else " " * 12 for w in plan.worlds)
        where = " (host)" if tables[plan.worlds[0]][i][2] == "host" else ""
        print(f"{name + where:<{width}}{cells}")
    needs = {w: need(tables[w]) for w in plan.worlds}
    label = "GPU" if plan.gpu_bytes else "host memory"
    print(f"{'peak, ' + label:<{width}}" + "".join(f"{needs[w][0] / GiB:12.2f}" for w in plan.worlds))
    world = plan.worlds[0]
    device_need, host_need = needs[world]
    available = plan.gpu_bytes if plan.gpu_bytes else plan.host_bytes / plan.local_ranks
    host_total = host_need * plan.local_ranks + (0 if plan.gpu_bytes else device_need * plan.local_ranks)
    print(f"available per rank: {available / GiB:.2f} GiB of {label}"
          + ("" if plan.gpu_bytes else f" ({plan.host_bytes / GiB:.1f} GiB shared by {plan.local_ranks} ranks)"))
    fits = device_need <= available and (not plan.gpu_bytes or host_total <= plan.host_bytes)
    if fits:
        print(f"fits: {device_need / GiB:.2f} of {available / GiB:.2f} GiB per rank with {world} rank(s)")
    else:
        print(f"does not fit: {device_need / GiB:.2f} GiB needed per rank, {available / GiB:.2f} available")
        for advice in _advice(tables[world], plan):
            print(f"  - {advice}")
        sp = sp_that_fits(plan, world, available)
        if sp:
            print(f"  - ulysses_sequence_parallel_size={sp} fits: {need(rows_for(replace(plan, sp=sp), world))[0] / GiB:.2f}"
                  f" GiB per rank (each sequence split over {sp} ranks; world = data-parallel x {sp})")
    for note in plan.notes:
        print(f"note: {note}")
    return fits


def sp_that_fits(plan: Plan, world: int, available: float) -> int | None:
    """The smallest ulysses_sequence_parallel_size above plan.sp that makes the run fit on `world`
    ranks, or None: it must divide the world and every model's attention and key-value heads."""
    models = [m for m in (plan.actor, plan.critic, plan.ref, plan.reward) if m is not None]
    for sp in range(plan.sp + 1, world + 1):
        if world % sp or any(m.heads % sp or (m.kv_heads or m.heads) % sp for m in models):
            continue
        if need(rows_for(replace(plan, sp=sp), world))[0] <= available:
            return sp
    return None


def _advice(rows, plan: Plan) -> list[str]:
    """The keys that shrink the largest terms, largest first."""
    tips = []
    for what, b, where in sorted(rows, key=lambda r: -r[1]):
        if where == "host" or b == 0:
            continue
        if "optimizer" in what or "gradients" in what:
            tip = ("launch with accelerate_configs/zero3.yaml (or zero2.yaml) to shard model states over ranks, "
                   "or zero3_offload.yaml to keep them in host memory") if (plan.zero_stage or 0) < 3 else \
                  "accelerate_configs/zero3_offload.yaml keeps optimizer states and weights in host memory"
        elif "activations" in what:
            tip = ("gradient_checkpointing=true" if not plan.gradient_checkpointing else "") + \
                  " / lower ppo_micro_batch_size_per_device (or use_dynamic_bsz with a smaller ppo_max_token_len_per_device)"
        elif "logits" in what:
            tip = "lower ppo_micro_batch_size_per_device (the logits grow with the vocabulary)"
        elif what.startswith("served reward model"):
            tip = "lower reward_model_gpu_memory_utilization" if plan.gpu_bytes else "lower reward_model_kv_cache_gb"
        elif what.startswith("judge"):
            tip = ("lower reward_judge_gpu_memory_utilization" if plan.gpu_bytes else "lower reward_judge_kv_cache_gb") \
                if plan.judge_engine == "vllm" else "lower rollout_micro_batch_size or reward_judge_prompt_length"
        elif "vLLM" in what:
            tip = "lower rollout_gpu_memory_utilization" if plan.gpu_bytes else "lower rollout_kv_cache_gb"
        elif "KV cache" in what:
            tip = "lower rollout_micro_batch_size"
        elif "gathered full actor" in what:
            tip = "rollout_engine=vllm (its own copy, asleep while the models train), or more memory per rank"
        elif "reference" in what:
            tip = "ref_offload=true (under ZeRO-3), or use_kl_loss=false and use_kl_in_reward=false"
        else:
            continue
        line = f"{what}: {b / GiB:.2f} GiB -> {tip.strip(' /')}"
        if line not in tips:
            tips.append(line)
    return tips[:4]


def machine() -> tuple[int | None, int, int]:
    """(GPU bytes or None, host bytes, this process's resident bytes now)."""
    import psutil
    import torch
    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return gpu, psutil.virtual_memory().total, psutil.Process(os.getpid()).memory_info().rss
