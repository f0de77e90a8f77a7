"""Build the W3 benchmark's tokenizer, models and prompts (docs/benchmarks.md), offline and seeded.

    python scripts/make_w3.py [--out runs/w3_assets]      # about 10-15 s on 2 CPU cores
    python scripts/make_w3.py --shape wide --out runs/wide_assets   # the held-out-like wide shape, about 25 s

Writes
  <out>/policy    Qwen2 (hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV heads, 512 positions,
                  tied embeddings, random init, fp32) and the tokenizer below
  <out>/reward    Qwen2ForSequenceClassification of the same shape (1 label, random init); the critic
                  starts from it; the reference is the policy's initial weights (ref_model_path '')
  <out>/prompts.parquet   prompts of 10-100 random words (22-241 tokens) in a `prompt` column
configs/w3.yaml points at these paths.

The tokenizer is a real byte-level BPE with a 32,768-token vocabulary (`<pad>` 0, `<s>` 1, `</s>` 2,
`<unk>` 3, then the 256 byte symbols, then merges), trained with `tokenizers` on ~4 MB of synthetic
text: 32,000 "words" (lowercase, 2-9 letters) drawn with Zipf-like frequencies (p ~ 1/rank). It uses
Qwen2's own pre-tokenizer (its split regex, then ByteLevel) and the ByteLevel decoder, because
transformers 5 loads a qwen2 directory's tokenizer as Qwen2Tokenizer, which rebuilds exactly that
pipeline from tokenizer.json's vocab and merges (a custom pipeline would be silently dropped). The
prompts draw their words uniformly from the 32,000, so rare words split into several tokens (about
2.2 tokens per word, mean about 121 tokens per prompt); a prompt outside 22-241 tokens is redrawn.
At the end the directory is loaded back with AutoTokenizer (as train_ppo.py and TRL load it) and
checked: vocabulary size, special ids, token counts equal to the trained tokenizer's, and
decode(encode(x)) == x.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2ForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from make_demo import build_tiny_qwen2

try:   # the split regex Qwen2Tokenizer rebuilds its pipeline with
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
except ImportError:  # pragma: no cover - older transformers: Qwen2's published pattern
    PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                         r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

SEED = 0
VOCAB_SIZE = 32768
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, as docs/benchmarks.md fixes
N_WORD_TYPES = 32000        # distinct synthetic "words"
CORPUS_WORDS = 600_000      # words of training text (~4 MB)
WORDS_PER_LINE = 50
PROMPT_WORDS = (10, 100)    # words per prompt, inclusive
PROMPT_TOKENS = (22, 241)   # tokens per prompt, inclusive (docs/benchmarks.md)
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))

W3_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
# --shape wide: a held-out-like shape (docs/benchmarks.md): twice the vocabulary (from twice the word
# types, so that BPE finds the merges) and a model twice as wide, otherwise W3's construction
WIDE = dict(VOCAB_SIZE=65536, N_WORD_TYPES=64000, CORPUS_WORDS=1_500_000,
            W3_SHAPE=dict(W3_SHAPE, vocab_size=65536, hidden_size=512, intermediate_size=1536,
                          num_attention_heads=8, num_key_value_heads=4))


def use_wide_shape() -> None:
    """The module's sizes set to WIDE's (a script's one run)."""
    globals().update(WIDE)


def make_words(rng: np.random.Generator) -> list[str]:
    """N_WORD_TYPES distinct lowercase strings of 2-9 letters, in rank order (rank 1 = most frequent)."""
    words, seen = [], set()
    while len(words) < N_WORD_TYPES:
        word = "".join(rng.choice(LETTERS, size=int(rng.integers(2, 10))))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def make_corpus(rng: np.random.Generator, words: list[str]) -> list[str]:
    """CORPUS_WORDS words drawn with Zipf-like frequencies (p ~ 1/rank), WORDS_PER_LINE per line."""
    p = 1.0 / np.arange(1, len(words) + 1)
    idx = rng.choice(len(words), size=CORPUS_WORDS, p=p / p.sum())
    return [" ".join(words[i] for i in idx[j:j + WORDS_PER_LINE]) for j in range(0, CORPUS_WORDS, WORDS_PER_LINE)]


def train_bpe(corpus: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE with Qwen2's pipeline (NFC, split regex + ByteLevel, ByteLevel decoder)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"BPE training gave {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}: the corpus is too small")
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, (special, tok.token_to_id(special))
    # No post-processor: a prompt is encoded without BOS/EOS, as train_ppo.py and TRL both expect.
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left")


def make_prompts(rng: np.random.Generator, words: list[str], tokenizer, n: int) -> tuple[list[str], list[int]]:
    """n prompts of 10-100 words drawn uniformly from the word list; redrawn until 22-241 tokens."""
    prompts, lengths = [], []
    while len(prompts) < n:
        count = int(rng.integers(PROMPT_WORDS[0], PROMPT_WORDS[1] + 1))
        text = " ".join(words[i] for i in rng.integers(0, len(words), size=count))
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if PROMPT_TOKENS[0] <= length <= PROMPT_TOKENS[1]:
            prompts.append(text)
            lengths.append(length)
    return prompts, lengths


def check_reloaded(directory: Path, trained, prompts: list[str]) -> str:
    """Load the directory as the trainers do (AutoTokenizer) and check it is the tokenizer we trained."""
    loaded = AutoTokenizer.from_pretrained(directory)
    problems = []
    if len(loaded) != VOCAB_SIZE:
        problems.append(f"len(tokenizer) = {len(loaded)}, not {VOCAB_SIZE}")
    for name, want in (("pad", 0), ("bos", 1), ("eos", 2), ("unk", 3)):
        if getattr(loaded, f"{name}_token_id") != want:
            problems.append(f"{name}_token_id = {getattr(loaded, f'{name}_token_id')}, not {want}")
    for text in prompts[:50] + ["hello world", "the quick brown fox"]:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        if ids != trained(text, add_special_tokens=False)["input_ids"]:
            problems.append(f"{type(loaded).__name__} tokenizes {text[:40]!r}... differently from the trained BPE")
        if text in prompts and not PROMPT_TOKENS[0] <= len(ids) <= PROMPT_TOKENS[1]:
            problems.append(f"prompt of {len(ids)} tokens: {text[:40]!r}...")
        if loaded.decode(ids) != text:
            problems.append(f"decode(encode(x)) != x for {text[:40]!r}...")
    if problems:
        raise SystemExit(f"{directory}: the saved tokenizer does not survive AutoTokenizer:\n  " + "\n  ".join(problems))
    return type(loaded).__name__


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/w3_assets")
    parser.add_argument("--prompts", type=int, default=2048)
    parser.add_argument("--shape", choices=("w3", "wide"), default="w3",
                        help="wide: a 65,536-token vocabulary and hidden 512 (a held-out-like shape)")
    args = parser.parse_args()
    if args.shape == "wide":
        use_wide_shape()
    out = Path(args.out)
    start = time.perf_counter()
    rng = np.random.default_rng(SEED)
    words = make_words(rng)
    tokenizer = train_bpe(make_corpus(rng, words))

    policy = build_tiny_qwen2(**W3_SHAPE, seed=SEED)   # pad 0, bos 1, eos 2, tied embeddings, fp32
    policy.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")
    torch.manual_seed(SEED + 1)
    reward = Qwen2ForSequenceClassification(policy.config.__class__(**{**policy.config.to_dict(), "num_labels": 1}))
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(out / "reward")
    tokenizer.save_pretrained(out / "reward")

    prompts, lengths = make_prompts(rng, words, tokenizer, args.prompts)
    pd.DataFrame({"prompt": prompts}).to_parquet(out / "prompts.parquet")
    loaded_as = check_reloaded(out / "policy", tokenizer, prompts)
    check_reloaded(out / "reward", tokenizer, prompts)
    n_params = sum(p.numel() for p in policy.parameters())
    print(f"W3 assets in {out} ({time.perf_counter() - start:.1f} s): policy {n_params} parameters, vocab "
          f"{VOCAB_SIZE} (loads as {loaded_as}); {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, "
          f"mean {np.mean(lengths):.1f}")


if __name__ == "__main__":
    main()
