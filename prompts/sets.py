"""Prompt and SFT sets: parquet/jsonl tables read, prompts rendered and tokenized, and the
problems with them reported as one line naming the file and key.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from config import Config, _split_files
from errors import UserError, first_line


def read_table(path: str):
    """A parquet or jsonl file as a DataFrame with at least one row; problems name the file."""
    import pandas as pd
    if not Path(path).is_file():
        raise UserError(f"{path}: no such file")
    if not path.endswith((".parquet", ".jsonl", ".json")):
        raise UserError(f"{path}: unsupported file type (use .parquet or .jsonl)")
    kind = "parquet" if path.endswith(".parquet") else "JSON lines"
    try:
        frame = pd.read_parquet(path) if kind == "parquet" else _read_json_lines(path)
    except UserError:
        raise
    except Exception as e:   # pyarrow and pandas raise many types for a damaged file
        raise UserError(f"{path}: cannot be read as {kind}: {first_line(e)}") from None
    if len(frame) == 0:
        raise UserError(f"{path}: the file has no rows")
    return frame


def _read_json_lines(path: str):
    """One JSON object per line; a line that is not one is named by its number."""
    import pandas as pd
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}: line {number} is not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}: line {number} is a JSON {type(row).__name__}, not an object of columns")
            rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class PromptSet:
    texts: list[str]                 # the prompt as the model sees it (chat template applied)
    ids: list[list[int]]             # its token ids
    columns: dict[str, list]         # other dataset columns the reward function asks for (e.g. ground_truth)
    rows: list[dict] = field(default_factory=list)   # keep_rows: every column of each row (multi-turn tools)

    def take(self, idx, repeat: int = 1) -> "PromptSet":
        """Rows idx, each repeated `repeat` times in place (one per sampled response)."""
        pick = lambda values: [values[i] for i in idx for _ in range(repeat)]   # noqa: E731
        return PromptSet(pick(self.texts), pick(self.ids), {k: pick(v) for k, v in self.columns.items()},
                         pick(self.rows) if self.rows else [])


def load_prompts(files: str, key: str, tokenizer, max_len: int, truncation: str, columns=(), reward_fn="the reward",
                 keep_rows: bool = False, template_kwargs: dict | None = None) -> PromptSet:
    """Prompts from parquet/jsonl files, tokenized; every problem names the file (and row).
    template_kwargs: chat_template_kwargs, for prompts given as chat messages."""
    out = PromptSet([], [], {c: [] for c in columns})
    for path in _split_files(files):
        frame = read_table(path)
        if key not in frame.columns:
            raise UserError(f"{path}: no column {key!r} (prompt_key); its columns are {list(frame.columns)}")
        for column in columns:
            if column not in frame.columns:
                raise UserError(f"{path}: no column {column!r}, which {reward_fn} takes; its columns are "
                                f"{list(frame.columns)}")
        kept = []
        texts = [_render_prompt(prompt, tokenizer, path, row, f"{key!r} (prompt_key)", template_kwargs)
                 for row, prompt in enumerate(frame[key])]
        # one call for the file: a fast tokenizer encodes the batch at once (a call per prompt was 4x its time)
        encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        for row, (text, tokens) in enumerate(zip(texts, encoded)):
            if not tokens and text.strip():
                raise UserError(f"{path}: row {row}: the tokenizer of model_path turns the prompt {text[:60]!r} into no "
                                "tokens (its vocabulary does not cover this text): check model_path's tokenizer files")
            if not tokens:
                raise UserError(f"{path}: row {row} has an empty prompt")
            if len(tokens) > max_len:
                if truncation == "drop":
                    continue
                if truncation != "left":
                    raise UserError(f"{path}: row {row} has a prompt of {len(tokens)} tokens > max_prompt_length="
                                    f"{max_len} (raise it, or set prompt_truncation=left or drop)")
                tokens = tokens[-max_len:]
            kept.append(row)
            out.texts.append(text)
            out.ids.append(tokens)
        for column in columns:
            values = frame[column].tolist()
            out.columns[column] += [values[i] for i in kept]
        if keep_rows:   # plain Python values (parquet gives numpy arrays for lists)
            records = frame.to_dict("records")
            out.rows += [{k: _plain(v) for k, v in records[i].items()} for i in kept]
        if len(kept) < len(frame):
            print(f"{path}: {len(frame) - len(kept)} of {len(frame)} prompts are longer than max_prompt_length="
                  f"{max_len} and left out (prompt_truncation=drop)", file=sys.stderr, flush=True)
            if not kept:
                raise UserError(f"{path}: every prompt is longer than max_prompt_length={max_len}")
    return out


def load_sft(cfg: Config, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """SFT pairs from parquet/jsonl files -> (prompt ids, response ids + EOS), held to the rollout's
    limits (max_prompt_length, max_response_length); every problem names the file and row."""
    prompts, responses = [], []
    for path in _split_files(cfg.sft_files):
        frame = read_table(path)
        for key, column in (("sft_prompt_key", cfg.sft_prompt_key), ("sft_response_key", cfg.sft_response_key)):
            if column not in frame.columns:
                raise UserError(f"{path}: no column {column!r} ({key}); its columns are {list(frame.columns)}")
        for row, (prompt, response) in enumerate(zip(frame[cfg.sft_prompt_key], frame[cfg.sft_response_key])):
            p = tokenizer(_render_prompt(prompt, tokenizer, path, row, f"{cfg.sft_prompt_key!r} (sft_prompt_key)",
                                         cfg.chat_template_kwargs),
                          add_special_tokens=False)["input_ids"]
            if not isinstance(response, str) or not response:
                raise UserError(f"{path}: row {row}: the SFT response must be a non-empty string, got {response!r}")
            r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for what, n, key in (("prompt", len(p), "max_prompt_length"), ("response (with EOS)", len(r),
                                                                          "max_response_length")):
                if n == 0 or n > getattr(cfg, key):
                    raise UserError(f"{path}: row {row} has an SFT {what} of {n} tokens; it must have 1 to "
                                    f"{key}={getattr(cfg, key)}")
            prompts.append(p)
            responses.append(r)
    return prompts, responses


def _plain(value):
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _render_prompt(prompt, tokenizer, path, row, column: str = "the prompt column", template_kwargs=None) -> str:
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{path}: row {row} is a list of chat messages, but the tokenizer of model_path has no "
                            f"chat template to render them: give plain-string prompts or a model with one")
        try:
            return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                 **(template_kwargs or {}))
        except Exception as e:
            raise UserError(f"{path}: row {row}: the chat template cannot render these messages: {e}") from None
    raise UserError(f"{path}: row {row}: a prompt must be a string or a list of chat messages, got "
                    f"{type(prompt).__name__} {prompt!r:.40} in column {column}")
