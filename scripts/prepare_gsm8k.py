"""Turn GSM8K (the Hugging Face "openai/gsm8k" dataset, config "main") into this toolkit's parquet files.

    python scripts/prepare_gsm8k.py --train PATH --test PATH [--out data/gsm8k]
    python scripts/prepare_gsm8k.py [--out data/gsm8k]        # with network: datasets.load_dataset

The inputs are GSM8K as published: parquet or jsonl files with a `question` column and an `answer`
column whose worked solution ends in "#### <number>" (on the hub: main/train-00000-of-00001.parquet
and main/test-00000-of-00001.parquet; the original release's train.jsonl and test.jsonl also work).
Several files per split may be given, comma-separated.

Writes <out>/train.parquet (from the train split) and <out>/val.parquet (from the test split, as verl
validates on it), one row per problem, with:
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]  (chat messages; the
                  trainer renders them with the model's chat template)
    ground_truth  the number after "####", commas removed ("1,234" -> "1234"): what rewards.gsm8k
                  compares the model's answer with
    question, answer   GSM8K's own fields, kept for reference
configs/gsm8k_qwen2.5_0.5b.yaml reads data/gsm8k/{train,val}.parquet (relative to the repo root).
"""
import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from errors import UserError
from prompts import sets  # its read_table: one reader of parquet/jsonl files
from rewards.gsm8k import extract_answer  # one definition of "the number after ####"

# verl's examples/data_preprocess/gsm8k.py uses this exact instruction, so results compare.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
COLUMNS = ("question", "answer")


def read_table(path: str) -> pd.DataFrame:
    """One GSM8K file as a DataFrame; any problem names the file."""
    try:
        frame = sets.read_table(path)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    for column in COLUMNS:
        if column not in frame.columns:
            raise SystemExit(f"error: {path}: no column {column!r} (GSM8K has 'question' and 'answer'); "
                             f"its columns are {list(frame.columns)}")
    return frame


def convert(frame: pd.DataFrame, source: str) -> pd.DataFrame:
    """GSM8K rows (question, answer) -> the toolkit's rows (prompt, ground_truth, question, answer)."""
    rows = []
    for i, (question, answer) in enumerate(zip(frame["question"], frame["answer"])):
        if not isinstance(question, str) or not question.strip():
            raise SystemExit(f"error: {source}: row {i}: 'question' is empty or not text: {question!r}")
        truth = extract_answer(answer, "strict") if isinstance(answer, str) else None
        if truth is None:
            raise SystemExit(f"error: {source}: row {i}: 'answer' does not end in '#### <number>': {answer!r}")
        rows.append({"prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                     "ground_truth": truth, "question": question, "answer": answer})
    return pd.DataFrame(rows, columns=["prompt", "ground_truth", "question", "answer"])


def load_split(files: str) -> pd.DataFrame:
    paths = [p.strip() for p in files.split(",") if p.strip()]
    return pd.concat([convert(read_table(p), p) for p in paths], ignore_index=True)


def load_from_hub() -> tuple[pd.DataFrame, pd.DataFrame]:
    try:
        import datasets
    except ImportError:
        raise SystemExit("error: give --train and --test files (pip install datasets to download them instead)") from None
    try:
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:
        raise SystemExit(f"error: cannot download openai/gsm8k ({type(e).__name__}: {e}); "
                         "download its parquet files yourself and pass --train and --test") from None
    return (convert(ds["train"].to_pandas(), "openai/gsm8k train"),
            convert(ds["test"].to_pandas(), "openai/gsm8k test"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--train", default="", help="GSM8K train split: parquet/jsonl file(s), comma-separated")
    parser.add_argument("--test", default="", help="GSM8K test split (becomes val.parquet): parquet/jsonl file(s)")
    parser.add_argument("--out", default="data/gsm8k", help="output folder for train.parquet and val.parquet")
    args = parser.parse_args(argv)
    if bool(args.train) != bool(args.test):
        parser.error("give both --train and --test, or neither (to download with datasets)")
    train, val = (load_split(args.train), load_split(args.test)) if args.train else load_from_hub()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train.to_parquet(out / "train.parquet", index=False)
    val.to_parquet(out / "val.parquet", index=False)
    print(f"wrote {out / 'train.parquet'} ({len(train)} rows) and {out / 'val.parquet'} ({len(val)} rows)")


if __name__ == "__main__":
    main()
