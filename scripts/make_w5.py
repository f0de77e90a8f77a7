"""Build the W5 benchmark's models and prompts from W3's: long responses that end at EOS after very different lengths.

    python scripts/make_w5.py [--w3 runs/w3_assets] [--out runs/w5_assets]   # about 20 s on 2 CPU cores
    python scripts/make_w5.py --sample 16      # also sample 16 responses of up to 2,048 tokens and report their lengths (minutes)

W5 is W3 (scripts/make_w3.py; built first if missing) with responses of up to 2,048 tokens: the same
architecture (Qwen2, hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV heads, tied embeddings, fp32),
the same 32,768-token BPE and the same prompts, with max_position_embeddings raised to 4,096 (W3's
512 cannot hold a prompt and 2,048 response tokens). Writes
  <out>/policy    W3's policy with the EOS mechanism below and 4,096 positions, and the tokenizer
  <out>/reward    W3's reward model with 4,096 positions (the critic starts from it), and the tokenizer
  <out>/prompts.parquet   W3's prompts (22-241 tokens)
configs/w5.yaml points at these paths.

Why the policy is changed: a randomly initialised model spreads its next-token probability almost
evenly over the 32,768 tokens, so it samples EOS about once in 32k tokens and every response would run
to max_response_length, the same length for all, which is W3's fixed-length shape again. W5 needs
responses that stop at EOS after very different lengths, with the same distribution for both trainers.

The mechanism: a constant per-token EOS probability p, so response lengths are geometric (mean about
1/p, cut at max_response_length). A logit that does not depend on the context needs a hidden
component that does not either. So every token's input embedding gets the same value C = 1.0 in
dimension 0: the residual stream then carries a near-constant dimension 0, and after the final RMSNorm
h_0 is 3.86 +- 0.06 over response positions (it is 0.11 +- 0.60 in W3's model), while the other 255
dimensions, and so the other tokens' logits, barely change (their spread across the vocabulary is
0.31 either way). The embeddings are tied, so the LM head's column 0 is C for every token too: that
adds the same C * h_0 to every logit, which softmax ignores. Then the EOS row of the (tied) embedding
is set to (C + delta, 0, ..., 0): EOS's logit is (C + delta) * h_0 against the others' C * h_0 plus
their own small random part, and delta is solved from the measured h_0 and the other tokens'
log-sum-exp so that p(EOS) = --eos_p. The pad row gets (C - 5, 0, ..., 0), so `<pad>` (which TRL reads
as the end of a response wherever it appears) is never sampled. The EOS and pad rows are also those
tokens' input embeddings; neither is ever an input the outputs depend on (a response ends at its EOS;
pad positions are masked). The reward model is W3's, untouched but for the positions.

Measured (seed 0, --eos_p 1/700): h_0 3.861 +- 0.056, delta 1.009; p(EOS) teacher-forced over 4 prompts x
1,025 positions (a prompt, then random tokens): mean 1.43e-3 (the target), range 1.20e-3 to 1.73e-3, so
lengths are close to geometric with mean 700 uncut. Sampled with --sample 16 (temperature 1, up to 2,048
tokens; 16 responses, so +-25% on the mean): 8 to 2,048 tokens, mean 802, median 744, quartiles 400 /
1,084, 1 of 16 at 2,048. Cut at 512: mean 413, 62% at the cap; at 1,024: mean 661, 31%; at 2,048: mean 802,
6% (the geometric law: 363 / 538 / 663 and 48% / 23% / 5%). A W5 iteration's 8 responses therefore
range from a few tokens to the cap, and TRL pads all 8 to the longest of them.
"""
import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
POSITIONS = 4096          # a prompt (at most 241 tokens) and a 2,048-token response, with room
CONSTANT = 1.0            # C: every input embedding's dimension 0
PAD_OFFSET = 5.0          # the pad row's dimension 0 is C - this: its logit ~19 below the rest
PROBE_TOKENS = 1024       # teacher-forced random tokens after each probe prompt
PROBE_PROMPTS = 4
CAPS = (512, 1024, 2048)


@torch.no_grad()
def probe(model, prompts: list[list[int]], eos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over response-like positions (a prompt, then uniformly random tokens, which is what this model
    samples): h_0 (the final hidden state's dimension 0), the log-sum-exp of every token's logit but
    EOS's, and p(EOS).                                                                # each [N]"""
    gen = torch.Generator().manual_seed(SEED)
    h0, lse_rest, p_eos = [], [], []
    for ids in prompts:
        tail = torch.randint(4, model.config.vocab_size, (PROBE_TOKENS,), generator=gen).tolist()
        hidden = model.model(input_ids=torch.tensor([ids + tail])).last_hidden_state[0, len(ids) - 1:]   # [N, H]
        logits = model.lm_head(hidden)                                                 # [N, V]
        rest = torch.cat([logits[:, :eos_id], logits[:, eos_id + 1:]], dim=-1)         # [N, V - 1]
        h0.append(hidden[:, 0])
        lse_rest.append(torch.logsumexp(rest, dim=-1))
        p_eos.append(torch.softmax(logits, dim=-1)[:, eos_id])
    return torch.cat(h0), torch.cat(lse_rest), torch.cat(p_eos)


def add_eos_mechanism(model, prompts: list[list[int]], eos_id: int, pad_id: int, eos_p: float) -> dict:
    """The mechanism in the docstring, in place; returns what the probe measured before and after."""
    emb = model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() == emb.data_ptr(), "W3's policy has tied embeddings"
    with torch.no_grad():
        emb[:, 0] = CONSTANT
        emb[eos_id] = 0.0
        emb[pad_id] = 0.0
        emb[pad_id, 0] = CONSTANT - PAD_OFFSET
        emb[eos_id, 0] = CONSTANT      # for now EOS's logit is C * h_0, a plain reference
        h0, lse_rest, _ = probe(model, prompts, eos_id)
        # p = e^{(C + d) h0} / (e^{(C + d) h0} + e^{lse_rest})  =>  d = (logit(p) + lse_rest - C h0) / h0
        target = math.log(eos_p / (1 - eos_p))
        delta = float(((target + lse_rest - CONSTANT * h0) / h0).median())
        emb[eos_id, 0] = CONSTANT + delta
        _, _, p_eos = probe(model, prompts, eos_id)
    return {"h0_mean": h0.mean().item(), "h0_std": h0.std().item(), "delta": delta,
            "p_mean": p_eos.mean().item(), "p_min": p_eos.min().item(), "p_max": p_eos.max().item()}


@torch.no_grad()
def sample_lengths(model, tokenizer, prompts: list[list[int]], max_new: int, batch: int = 16) -> list[int]:
    """Response lengths (tokens up to and including EOS, or max_new without one), sampled at temperature 1."""
    torch.manual_seed(SEED)
    lengths = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        enc = tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt")   # left-padded
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            lengths.append(row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row))
        print(f"  sampled {len(lengths)}/{len(prompts)}", flush=True)
    return lengths


def describe(lengths: list[int], eos_p: float) -> str:
    a = np.array(lengths)
    lines = [f"sampled lengths: {a.min()} to {a.max()}, mean {a.mean():.0f}, median {np.median(a):.0f}, "
             f"quartiles {np.percentile(a, 25):.0f} / {np.percentile(a, 75):.0f}"]
    for cap in CAPS:
        expect = (1 - (1 - eos_p) ** cap) / eos_p       # the mean of a geometric length cut at cap
        lines.append(f"  cut at {cap}: mean {np.minimum(a, cap).mean():.0f}, {np.mean(a >= cap):.0%} at the cap "
                     f"(geometric: {expect:.0f}, {(1 - eos_p) ** (cap - 1):.0%})")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--w3", default="runs/w3_assets", help="W3's assets (built with scripts/make_w3.py if missing)")
    parser.add_argument("--out", default="runs/w5_assets")
    parser.add_argument("--eos_p", type=float, default=1 / 700, help="per-token EOS probability of the policy")
    parser.add_argument("--sample", type=int, default=0,
                        help="also sample this many responses of up to 2,048 tokens and report their lengths")
    args = parser.parse_args()
    start = time.perf_counter()
    w3, out = Path(args.w3), Path(args.out)
    if not (w3 / "policy" / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_w3.py"), "--out", str(w3)], check=True)
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(w3 / "policy")
    prompt_texts = pd.read_parquet(w3 / "prompts.parquet")["prompt"].tolist()
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompt_texts]

    policy = AutoModelForCausalLM.from_pretrained(w3 / "policy", dtype=torch.float32).eval()
    policy.config.max_position_embeddings = POSITIONS
    stats = add_eos_mechanism(policy, prompts[:PROBE_PROMPTS], tokenizer.eos_token_id, tokenizer.pad_token_id,
                              args.eos_p)
    policy.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")
    reward = AutoModelForSequenceClassification.from_pretrained(w3 / "reward", dtype=torch.float32)
    reward.config.max_position_embeddings = POSITIONS
    reward.save_pretrained(out / "reward")
    tokenizer.save_pretrained(out / "reward")
    pd.DataFrame({"prompt": prompt_texts}).to_parquet(out / "prompts.parquet")
    print(f"W5 assets in {out} ({time.perf_counter() - start:.1f} s): {len(prompts)} prompts, {POSITIONS} positions; "
          f"h_0 {stats['h0_mean']:.3f} +- {stats['h0_std']:.3f}, EOS row dimension 0 = {CONSTANT} + "
          f"{stats['delta']:.4f}; p(EOS) over {PROBE_PROMPTS} x {PROBE_TOKENS} positions: mean {stats['p_mean']:.3g} "
          f"(target {args.eos_p:.3g}), range {stats['p_min']:.3g} to {stats['p_max']:.3g}", flush=True)
    if args.sample:
        reloaded = AutoModelForCausalLM.from_pretrained(out / "policy", dtype=torch.float32).eval()
        lengths = sample_lengths(reloaded, tokenizer, prompts[-args.sample:], max(CAPS))
        print(describe(lengths, args.eos_p))


if __name__ == "__main__":
    main()
