"""One rank of tests/test_ulysses.py, under `accelerate launch` (2 processes, ZeRO-3, gloo).

Both ranks hold the same GQA model (4 heads, 2 key-value heads) and the same micro-batch. First,
before any sequence parallelism exists, each computes the unsplit numbers (sp=1, the default
path): per-token log-probs, entropy and top-k/top-p log-probs, the gradients of a PPO-like loss,
one SGD step's weights, and a value model's values and reward-model scores. Then, with sp=2 (forward/ulysses.py), the same from the row split
over both ranks: with the model replicated (the chunked LM head), and as a ZeRO-3 engine (the
model's own logits; weights after engine.step()). Rank 0 writes the largest differences to the
JSON file named on the command line, and what the split gives without DeepSpeed's all-to-all
(each rank attending only within its own half), which must differ.
"""
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from transformers import Qwen2Config, Qwen2ForCausalLM

from forward import packing, readouts, ulysses
from forward.batch import pack_batch
from modeling import value_models

TEMPERATURE, TRUNCATION, LR = 0.7, (5, 0.9), 1.0
# SGD, not AdamW: Adam's first step is lr * g / (|g| + eps), which turns fp32 rounding of gradients near
# eps (1e-8 here, on elements of 1e-8 .. 1e-7) into differences of a sizeable fraction of lr


def make_model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).float().eval()
    model.set_attn_implementation(packing.register())
    model.head_transform = readouts.head_transform(model)[0]
    return model


def make_value_model():
    """A critic (or reward model) of the same GQA shape: the backbone and a one-output head."""
    torch.manual_seed(2)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa", num_labels=1)
    model = value_models.from_config(config).float().eval()
    model.set_attn_implementation(packing.register())
    return model


def make_batch():
    g = torch.Generator().manual_seed(1)
    prompts = [3, 7, 5, 2, 9]
    responses = [6, 1, 8, 4, 5]   # 51 tokens in all: the row is padded to 52 for 2 ranks
    batch = pack_batch([torch.randint(1, 64, (n,), generator=g).tolist() for n in prompts],
                       [torch.randint(1, 64, (n,), generator=g).tolist() for n in responses], pad_id=0)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g)   # [B, R]
    return batch


def make_lopsided_batch():
    """One sequence of a 20-token prompt and a 2-token response: the row's first half (rank 0's)
    holds no response position, so that rank scores nothing and must still take part."""
    g = torch.Generator().manual_seed(3)
    batch = pack_batch([torch.randint(1, 64, (20,), generator=g).tolist()],
                       [torch.randint(1, 64, (2,), generator=g).tolist()], pad_id=0)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g)   # [1, 2]
    return batch


def loss_of(model, batch):
    """A PPO-shaped loss: advantage-weighted log-probs and an entropy bonus, masked token mean."""
    logprob, entropy = readouts.response_logprobs(model, batch, TEMPERATURE, with_entropy=True, entropy_grad=True)
    mask = batch["response_mask"]
    return -((logprob * batch["advantages"] + 0.01 * entropy) * mask).sum() / mask.sum()


def maxdiff(a, b):
    return float((a.detach().float() - b.detach().float()).abs().max())


def main(out_path):
    plugin = DeepSpeedPlugin(hf_ds_config={
        "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "train_batch_size": 2, "bf16": {"enabled": False}, "gradient_clipping": 0.0})   # no clipping: the reference step has none
    accelerator = Accelerator(deepspeed_plugins={"actor": plugin}, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    batch = make_batch()
    model = make_model()

    # sp=1: the default path, before any SP group exists (what one process computes)
    with torch.no_grad():
        ref_lp, ref_ent, ref_trunc = readouts.response_logprobs(model, batch, TEMPERATURE, with_entropy=True,
                                                                truncation=TRUNCATION)
    model.zero_grad()
    loss_of(model, batch).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    lopsided = make_lopsided_batch()
    with torch.no_grad():
        ref_lopsided = readouts.response_logprobs(model, lopsided, TEMPERATURE, with_entropy=True,
                                                  truncation=TRUNCATION)
    model.zero_grad()
    loss_of(model, lopsided).backward()
    ref_lopsided_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stepped = copy.deepcopy(model)
    optim = torch.optim.SGD(stepped.parameters(), lr=LR)
    optim.zero_grad()
    ref_loss = loss_of(stepped, batch)
    ref_loss.backward()
    optim.step()
    ref_weights = {n: p.detach().clone() for n, p in stepped.named_parameters()}
    model.zero_grad()
    critic = make_value_model()
    with torch.no_grad():
        ref_values, ref_scores = readouts.critic_values(critic, batch), readouts.reward_model_scores(critic, batch)
        ref_lopsided_values = readouts.critic_values(critic, lopsided)

    ulysses.setup(2)
    figures = {}
    # sp=2, the model replicated: the chunked LM head on each rank's positions
    with torch.no_grad():
        lp, ent, trunc = readouts.response_logprobs(model, batch, TEMPERATURE, with_entropy=True, truncation=TRUNCATION)
    figures.update(logprob=maxdiff(lp, ref_lp), entropy=maxdiff(ent, ref_ent), truncated=maxdiff(trunc, ref_trunc))
    # the critic's values at the response positions, a reward model's score at each sequence's last token
    with torch.no_grad():
        figures.update(values=maxdiff(readouts.critic_values(critic, batch), ref_values),
                       reward_scores=maxdiff(readouts.reward_model_scores(critic, batch), ref_scores))
    loss_of(model, batch).backward()
    # each rank holds its positions' share of the gradient, times the group size (every rank
    # back-propagates the same combined loss): the sum over ranks / 2 is the whole gradient
    worst = 0.0
    for n, p in model.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g)
        worst = max(worst, maxdiff(g / 2, ref_grads[n]) / max(1e-8, float(ref_grads[n].abs().max())))
    figures["grad_relative"] = worst
    # a rank with no response position in its part of the row (the chunked head, no DeepSpeed)
    with torch.no_grad():
        lp, ent, trunc = readouts.response_logprobs(model, lopsided, TEMPERATURE, with_entropy=True,
                                                    truncation=TRUNCATION)
        values = readouts.critic_values(critic, lopsided)
    figures.update(lopsided_logprob=maxdiff(lp, ref_lopsided[0]), lopsided_entropy=maxdiff(ent, ref_lopsided[1]),
                   lopsided_truncated=maxdiff(trunc, ref_lopsided[2]),
                   lopsided_values=maxdiff(values, ref_lopsided_values))
    model.zero_grad()
    loss_of(model, lopsided).backward()
    worst = 0.0
    for n, p in model.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g)
        worst = max(worst, maxdiff(g / 2, ref_lopsided_grads[n]) / max(1e-8, float(ref_lopsided_grads[n].abs().max())))
    figures["lopsided_grad_relative"] = worst
    model.zero_grad()

    # sp=2 without DeepSpeed's all-to-all: each rank attends only within its half of the row
    part = ulysses.split(packing.pack(batch))
    inputs = part.model_inputs()
    with torch.no_grad(), packing.attention():
        with ulysses.sharded():
            together = model(**inputs, use_cache=False).logits                       # [1, L, V]
        # the row's sequence boundaries cut to this rank's positions
        local = torch.unique((part.cu_seqlens - part.start).clamp(0, part.length)).to(torch.int32)
        inputs.update(cu_seq_lens_q=local, cu_seq_lens_k=local)
        alone = model(**inputs, use_cache=False).logits                              # [1, L, V]
    # the largest over the ranks: rank 0's half starts the row, and causal attention never looks past it
    without = torch.tensor(maxdiff(alone, together))
    torch.distributed.all_reduce(without, op=torch.distributed.ReduceOp.MAX)
    figures["without_all_to_all"] = float(without)

    # sp=2 under ZeRO-3: the engine's own logits (partitioned head), then one optimizer step
    zero = make_model()
    engine, zero_optim = accelerator.prepare(zero, torch.optim.SGD(zero.parameters(), lr=LR))
    with torch.no_grad():
        lp, ent, trunc = readouts.response_logprobs(engine, batch, TEMPERATURE, with_entropy=True,
                                                    truncation=TRUNCATION)
    figures.update(zero3_logprob=maxdiff(lp, ref_lp), zero3_entropy=maxdiff(ent, ref_ent),
                   zero3_truncated=maxdiff(trunc, ref_trunc))
    with torch.no_grad():
        lp, ent = readouts.response_logprobs(engine, lopsided, TEMPERATURE, with_entropy=True)
    figures.update(zero3_lopsided_logprob=maxdiff(lp, ref_lopsided[0]),
                   zero3_lopsided_entropy=maxdiff(ent, ref_lopsided[1]))
    loss = loss_of(engine, batch)
    figures["zero3_loss"] = maxdiff(loss, ref_loss)
    engine.backward(loss)
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    worst = 0.0
    for n, p in engine.module.named_parameters():   # the gradient after ZeRO-3's reduction over the ranks
        worst = max(worst, maxdiff(safe_get_full_grad(p), ref_grads[n]) / max(1e-8, float(ref_grads[n].abs().max())))
    figures["zero3_grad_relative"] = worst
    engine.step()
    worst = 0.0
    for n, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            worst = max(worst, maxdiff(p, ref_weights[n]))
    figures["zero3_weights"] = worst
    figures["weights_moved"] = max(maxdiff(ref_weights[n], p) for n, p in make_model().named_parameters())
    if accelerator.is_main_process:
        Path(out_path).write_text(json.dumps(figures))
    print(f"rank {accelerator.process_index}: {figures}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
