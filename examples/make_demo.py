"""Regenerate the built-in demo's assets: data, tokenizer and a warm-started tiny model.

    python examples/make_demo.py        # from the repository root; about a minute on 2 CPU cores

Writes, deterministically (fixed seeds, no network):
    examples/data/train.parquet, examples/data/val.parquet   prompts like "47+38=" (+ answers)
    examples/demo_model/                                     tiny Qwen2 + char tokenizer

`python train_ppo.py` (no arguments) runs PPO from examples/demo_model on these prompts with the
0/1 verifier in rewards/arithmetic.py. PPO with a 0/1 reward only learns from samples that are
sometimes right, so the model is warm-started by a short supervised fine-tune, stopped early and
then sharpened (see `sharpen`): it already answers in the right format (digits, then EOS) but
gets only ~20-40% of sums right, leaving clear room for PPO to show progress within minutes.

`build_char_tokenizer` and `build_tiny_qwen2` are importable, so tests and benchmarks (W1 in
docs/benchmarks.md) build their tiny models the same way.
"""

import random
import shutil
import time
from pathlib import Path

import pandas as pd
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

EXAMPLES = Path(__file__).resolve().parent
DATA_DIR = EXAMPLES / "data"
MODEL_DIR = EXAMPLES / "demo_model"

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, the order W1 fixes (docs/benchmarks.md)
CHARS = "0123456789+-*=? abcdefghijklmnopqrstuvwxyz." + "\n"  # ids 4..47
VOCAB_SIZE = 64  # embedding rows; ids 48..63 are unused head-room
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

SEED = 0
N_VAL = 200  # validation prompts, disjoint from everything the model or PPO trains on
N_DEV = 200  # held out from train too: decides when the warm start stops, so val stays untouched
N_TRAIN = 4000  # PPO prompts; the warm start learns from these same prompts with their answers

# The warm start: stop at the first check where held-out greedy accuracy reaches TARGET_ACC and
# almost every answer is well formed. Accuracy climbs steeply once the model "gets" addition, so
# we check often and with a modest learning rate, which keeps the overshoot past the target small.
SFT_LR = 3e-4
SFT_BATCH = 64
SFT_EVAL_EVERY = 20  # optimizer steps
SFT_MAX_STEPS = 3000  # a safety net: reaching it means the recipe no longer works, so we fail
TARGET_ACC = 0.25
TARGET_FORMAT = 0.95
# Logit scale applied after the warm start (see sharpen): sampling at T=1 then behaves like the
# stopped model at T=1/SHARPEN, while greedy answers stay exactly the same.
SHARPEN = 2.0
MAX_NEW_TOKENS = 4  # longest answer "198" plus EOS


# ----------------------------------------------------------------------------------------------
# Tokenizer and model builders (imported by tests and benchmarks)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer: one token per character, ids fixed by W1 (docs/benchmarks.md)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # "[\s\S]" rather than "." so that newline, which "." does not match, is a token too.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # characters back together, no spaces in between
    # No post-processor: encoding a prompt adds no BOS/EOS, so "47+38=" is exactly 6 tokens and
    # the model's first generated token is the first digit of the answer.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        # Decoder-only generation continues from the last position, so batches pad on the left.
        padding_side="left",
    )


def build_tiny_qwen2(
    vocab_size: int = VOCAB_SIZE,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 256,
    seed: int = SEED,
) -> Qwen2ForCausalLM:
    """A randomly initialised fp32 Qwen2 with tied embeddings; defaults are the W1 policy shape."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)  # seeded, so "random init" is the same model every time
    return Qwen2ForCausalLM(config).float()


# ----------------------------------------------------------------------------------------------
# Data


def make_splits(seed: int = SEED) -> tuple[list[tuple[int, int]], ...]:
    """Disjoint (a, b) pairs of two-digit numbers for val, dev and train."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]  # all 8100 sums
    random.Random(seed).shuffle(pairs)
    val = pairs[:N_VAL]
    dev = pairs[N_VAL : N_VAL + N_DEV]
    train = pairs[N_VAL + N_DEV : N_VAL + N_DEV + N_TRAIN]
    return val, dev, train


def to_frame(pairs: list[tuple[int, int]]) -> pd.DataFrame:
    return pd.DataFrame(
        {"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )


def sft_tensors(tokenizer, frame: pd.DataFrame) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels for "47+38=85</s>", with the loss on the answer and EOS only.

    The prompt is masked out because PPO never asks the model to write prompts; EOS is kept in the
    loss so the model learns where to stop, which the verifier needs (trailing junk scores 0).
    """
    rows, labels = [], []
    for prompt, answer in zip(frame["prompt"], frame["answer"]):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(answer, add_special_tokens=False)["input_ids"] + [EOS_ID]
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(len(r) for r in rows)
    # Right padding is fine for teacher forcing: a causal model never attends to later pads.
    input_ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows])  # [N, T]
    label_ids = torch.tensor([ids + [-100] * (width - len(ids)) for ids in labels])  # [N, T]
    return input_ids, label_ids


# ----------------------------------------------------------------------------------------------
# Evaluation: the same question PPO's validation asks, with generate as PPO's rollout uses it


@torch.no_grad()
def evaluate(model, tokenizer, frame: pd.DataFrame, do_sample: bool, seed: int = SEED) -> dict:
    """Fraction of prompts answered exactly (digits then EOS), and fraction well formed."""
    model.eval()
    batch = tokenizer(list(frame["prompt"]), return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(seed)  # sampled accuracy is reproducible too
    # Plain sampling from the full distribution, as PPO's rollouts do (no top-k/top-p truncation).
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else {}
    out = model.generate(
        **batch,
        max_new_tokens=MAX_NEW_TOKENS,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        **(sampling or {"do_sample": False}),
    )
    responses = out[:, batch["input_ids"].shape[1] :].tolist()  # [N, <=4]
    digit_ids = set(tokenizer.convert_tokens_to_ids(list("0123456789")))
    correct = well_formed = 0
    for answer, ids in zip(frame["answer"], responses):
        if EOS_ID not in ids:
            continue
        body = ids[: ids.index(EOS_ID)]
        well_formed += len(body) > 0 and all(i in digit_ids for i in body)
        correct += tokenizer.decode(body) == answer
    model.train()
    return {"accuracy": correct / len(frame), "format": well_formed / len(frame)}


# ----------------------------------------------------------------------------------------------
# The warm start


def warm_start(model, tokenizer, train: pd.DataFrame, dev: pd.DataFrame) -> int:
    """Supervised fine-tune until held-out greedy accuracy first reaches TARGET_ACC; returns steps.

    A plain loop rather than TRL's SFTTrainer: the stopping rule (evaluate with generate every few
    steps, stop on a target) is the whole point here and is clearer written out than as callbacks.
    """
    input_ids, labels = sft_tensors(tokenizer, train)  # [N, T], [N, T]
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    order = torch.Generator().manual_seed(SEED)
    model.train()
    step = 0
    while step < SFT_MAX_STEPS:
        perm = torch.randperm(len(input_ids), generator=order)
        for start in range(0, len(perm) - SFT_BATCH + 1, SFT_BATCH):
            idx = perm[start : start + SFT_BATCH]
            loss = model(input_ids=input_ids[idx], labels=labels[idx]).loss  # HF shifts labels
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % SFT_EVAL_EVERY == 0:
                dev_metrics = evaluate(model, tokenizer, dev, do_sample=False)
                acc, fmt = dev_metrics["accuracy"], dev_metrics["format"]
                print(f"  sft step {step:4d}  loss {loss.item():.3f}  "
                      f"dev greedy acc {acc:.3f}  format {fmt:.3f}", flush=True)
                if acc >= TARGET_ACC and fmt >= TARGET_FORMAT:
                    return step
    raise RuntimeError(f"warm start missed dev accuracy {TARGET_ACC} in {SFT_MAX_STEPS} steps")


@torch.no_grad()
def sharpen(model, factor: float) -> None:
    """Multiply every logit by `factor` by scaling the final RMSNorm weight.

    Stopped this early, the model's distributions are flat: at T=1 it samples the right sum for
    only ~6% of val prompts (greedy: ~27%) and a malformed answer for ~12%, so PPO's rollouts see
    almost no reward. Logits are linear in the final norm's weight (the head is the tied embedding,
    with no bias), so this is an exact temperature change baked into the weights. In trial runs of
    a GRPO-style clipped update (64 prompts x 4 samples, lr 1e-4) the sharpened start gained
    ~20 points of greedy val accuracy in ~125-200 steps, while the unsharpened one first fell and
    then stalled near its start.
    """
    model.model.norm.weight.mul_(factor)


def main() -> None:
    t0 = time.time()
    val_pairs, dev_pairs, train_pairs = make_splits()
    val, dev, train = to_frame(val_pairs), to_frame(dev_pairs), to_frame(train_pairs)

    DATA_DIR.mkdir(parents=True, exist_ok=True)
    train.to_parquet(DATA_DIR / "train.parquet", index=False)
    val.to_parquet(DATA_DIR / "val.parquet", index=False)
    print(f"data: {len(train)} train, {len(val)} val prompts -> {DATA_DIR}")

    tokenizer = build_char_tokenizer()
    # Small, so that PPO steps are cheap on 2 CPU cores (the demo has 10 minutes); 2 layers are
    # enough to learn two-digit addition.
    model = build_tiny_qwen2(
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, max_position_embeddings=64
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2, {n_params:,} parameters; warm start on {len(train)} sums ...")
    steps = warm_start(model, tokenizer, train, dev)
    greedy_before = evaluate(model, tokenizer, val, do_sample=False)
    sampled_before = evaluate(model, tokenizer, val, do_sample=True)
    sharpen(model, SHARPEN)
    greedy = evaluate(model, tokenizer, val, do_sample=False)
    sampled = evaluate(model, tokenizer, val, do_sample=True)
    # A temperature change must not move a single greedy answer; if it did, sharpen is wrong.
    assert greedy == greedy_before, (greedy, greedy_before)
    print(f"after {steps} sft steps, val (greedy | sampled at T=1), accuracy and format:")
    print(f"  stopped model: {greedy_before['accuracy']:.3f}/{greedy_before['format']:.3f} | "
          f"{sampled_before['accuracy']:.3f}/{sampled_before['format']:.3f}")
    print(f"  sharpened x{SHARPEN} (saved): {greedy['accuracy']:.3f}/{greedy['format']:.3f} | "
          f"{sampled['accuracy']:.3f}/{sampled['format']:.3f}")

    # Greedy by default; PPO sets its own sampling parameters at rollout time.
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    shutil.rmtree(MODEL_DIR, ignore_errors=True)  # no stale files from an earlier recipe
    model.save_pretrained(MODEL_DIR)
    tokenizer.save_pretrained(MODEL_DIR)
    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir())
    print(f"model + tokenizer: {size / 1e6:.2f} MB -> {MODEL_DIR}")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
