"""Build the W1 benchmark's models and prompts (docs/benchmarks.md), offline and seeded.

    python scripts/make_w1.py [--out runs/w1_assets]

Writes <out>/policy (Qwen2, hidden 256, 4 layers, random init, the char tokenizer),
<out>/reward (Qwen2ForSequenceClassification of the same shape, 1 label, random init; the critic
starts from it) and <out>/prompts.parquet ("NN+NN=" prompts in a `prompt` column).
configs/w1.yaml points at these paths.
"""
import argparse
import random
import sys
from pathlib import Path

import pandas as pd
import torch
from transformers import Qwen2ForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from make_demo import build_char_tokenizer, build_tiny_qwen2

W1_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/w1_assets")
    parser.add_argument("--prompts", type=int, default=2048)
    args = parser.parse_args()
    out = Path(args.out)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    policy = build_tiny_qwen2(**W1_SHAPE)
    policy.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")
    torch.manual_seed(1)
    reward = Qwen2ForSequenceClassification(policy.config.__class__(**{**policy.config.to_dict(), "num_labels": 1}))
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(out / "reward")
    tokenizer.save_pretrained(out / "reward")
    rng = random.Random(0)
    prompts = [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(args.prompts)]
    pd.DataFrame({"prompt": prompts}).to_parquet(out / "prompts.parquet")
    print(f"W1 assets in {out}: policy {sum(p.numel() for p in policy.parameters())} parameters")


if __name__ == "__main__":
    main()
