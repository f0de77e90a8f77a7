"""An LLM judge as the reward (a generative reward model, RLAIF): the judge reads each sample
through a prompt template and its own chat template, writes a verdict, and a parser turns the
verdict into the score.

    reward_judge_path: the judge, a causal LM directory
    reward_judge_template: a Jinja file rendered with prompt, response and any dataset column
    reward_judge_parser: "module:function" called as fn(verdict_text, row) -> float or None
                         (row: prompt, response and the template's columns); a parameter named
                         judge_range gets reward_judge_range as (low, high)

A verdict the parser cannot read (None, an exception, a non-finite number) scores
reward_judge_fallback and is counted (reward/judge_parse_errors): a judge that rambles costs a
sample's score, never the run. The judge generates on the hf engine (its own frozen copy) or a vLLM
engine of its own, asleep outside scoring like the rollout engine; one batched call per scoring
call, on every rank (a rank with no samples calls it with none).
"""
from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import torch

from config import Config
from errors import UserError, first_line
from rewards.functions import load_function

BUILT_IN = ("prompt", "response")   # what the template always gets; any other name is a dataset column


# ----------------------------------------------------------------------------------------------
# Built-in verdict parsers.

_NUMBER = re.compile(r"(?<![/\d.])-?\d+(?:\.\d+)?")   # not a denominator ("7/10" reads 7)


def score_in_range(text: str, row: dict, judge_range: tuple[float, float] = (0.0, 10.0)) -> float | None:
    """"A number in a range": the verdict's last number that is not a denominator, within
    reward_judge_range = (low, high), scaled to [0, 1]; None without one, or outside the range."""
    low, high = judge_range
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    value = float(numbers[-1])
    if not low <= value <= high:
        return None
    return (value - low) / (high - low)


_CHOICE = re.compile(r"\[\[\s*([ABC])\s*\]\]")   # MT-Bench's "[[A]]" / "[[B]]" / "[[C]]" (a tie)


def prefer_a(text: str, row: dict) -> float | None:
    """"A/B preference" of the response (shown as A) against a reference answer (a dataset column
    the template shows as B): 1 if the judge prefers A, 0 if B, 0.5 for a tie (C); the verdict is
    the last "[[A]]"-style mark, or a verdict that is the bare letter. None otherwise."""
    marks = _CHOICE.findall(text)
    choice = marks[-1] if marks else text.strip().strip(".").upper()
    return {"A": 1.0, "B": 0.0, "C": 0.5}.get(choice)


# ----------------------------------------------------------------------------------------------

def load_template(path: str):
    """The judge's prompt template -> (the compiled template, the dataset columns it names)."""
    import jinja2
    from jinja2 import meta
    if not path:
        raise UserError("reward_judge_path is set but reward_judge_template is empty: give a Jinja file rendered "
                        "with prompt, response and any dataset column")
    file = Path(path)
    if not file.is_file():
        raise UserError(f"reward_judge_template: file {path} does not exist")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    source = file.read_text()
    try:
        names = meta.find_undeclared_variables(env.parse(source))
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"reward_judge_template {path}, line {e.lineno}: {e.message}") from None
    if not {"response"} & names:
        raise UserError(f"reward_judge_template {path} never shows the response ({{{{ response }}}}): the judge "
                        "would not see what it grades")
    return template, sorted(names - set(BUILT_IN))


def parse_range(value: str) -> tuple[float, float]:
    """reward_judge_range "low,high" -> (low, high), or a UserError."""
    try:
        low, high = (float(x) for x in value.split(","))
    except ValueError:
        raise UserError(f"reward_judge_range must be 'low,high' (e.g. 0,10), got {value!r}") from None
    if not low < high:
        raise UserError(f"reward_judge_range must have low < high, got {value!r}")
    return low, high


class Judge:
    """The judge of one run: the template and parser are read when it is built (a bad one stops the
    run before any model loads); start() loads the judge's engine."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.template, self.columns = load_template(cfg.reward_judge_template)
        self.parser = load_function(cfg.reward_judge_parser, "reward_judge_parser")
        try:
            takes_range = "judge_range" in inspect.signature(self.parser).parameters
        except (TypeError, ValueError):
            takes_range = False
        self.extra = {"judge_range": parse_range(cfg.reward_judge_range)} if takes_range else {}
        self.tokenizer = self.engine = None

    def start(self, world: int, rank: int, device=None) -> None:
        """The judge's tokenizer and engine (device: where the hf engine's copy runs)."""
        from transformers import AutoTokenizer

        from modeling.loading import _load
        self.tokenizer = _load("reward_judge_path", self.cfg.reward_judge_path, AutoTokenizer.from_pretrained,
                               "tokenizer")
        if self.tokenizer.eos_token_id is None:
            raise UserError(f"reward_judge_path: the tokenizer in {self.cfg.reward_judge_path} has no EOS token, so "
                            "no verdict could end: set eos_token in its tokenizer_config.json")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.engine = start_engine(self.cfg, self.tokenizer, world, rank, device)
        self.engine.sleep()   # awake only while it scores

    def prompt_ids(self, prompt: str, response: str, columns: dict) -> list[int]:
        """One sample's judge prompt: the template, then the judge's chat template (as the user's
        message) when the judge's tokenizer has one."""
        text = self.template.render(prompt=prompt, response=response, **columns)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, prompts: list[str], responses: list[str],
                 columns: dict) -> tuple[torch.Tensor, list[str], list[bool]]:
        """-> (one score per sample, the judge's verdicts, which were unreadable: fallback scores)."""
        from rollout import SamplingParams
        cfg = self.cfg
        rows = [{"prompt": p, "response": r, **{c: columns[c][i] for c in self.columns}}
                for i, (p, r) in enumerate(zip(prompts, responses))]
        try:
            ids = [self.prompt_ids(row["prompt"], row["response"], {c: row[c] for c in self.columns}) for row in rows]
        except Exception as e:   # the template is the user's: a filter or an attribute it reads may fail
            raise UserError(f"reward_judge_template {cfg.reward_judge_template} failed on prompt {prompts[0]!r}: "
                            f"{type(e).__name__}: {first_line(e)}") from None
        # a judge prompt over its length gets no verdict (fallback, counted), the rest are judged
        fits = [i for i, x in enumerate(ids) if len(x) <= cfg.reward_judge_prompt_length]
        params = SamplingParams(n=1, temperature=cfg.reward_judge_temperature, max_tokens=cfg.reward_judge_max_tokens)
        self.engine.wake_up()
        out = self.engine.generate([ids[i] for i in fits], params)   # every rank calls it, with none too
        self.engine.sleep()
        verdicts = [""] * len(rows)
        for i, tokens in zip(fits, out.responses):
            verdicts[i] = self.tokenizer.decode(tokens, skip_special_tokens=True)
        judged = set(fits)
        parsed = [self.parse(verdict, row) if i in judged else None
                  for i, (row, verdict) in enumerate(zip(rows, verdicts))]
        scores = [cfg.reward_judge_fallback if score is None else score for score in parsed]
        return torch.tensor(scores, dtype=torch.float32), verdicts, [score is None for score in parsed]

    def parse(self, verdict: str, row: dict) -> float | None:
        try:
            score = self.parser(verdict, row, **self.extra)
        except Exception:   # the parser is the user's: whatever it raises is an unreadable verdict
            return None
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            return None
        return float(score)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def start_engine(cfg: Config, tokenizer, world: int, rank: int, device=None):
    """The judge's engine: a vLLM engine of its own, or the hf engine on a frozen copy."""
    if cfg.reward_judge_engine == "vllm":
        from rollout.vllm import VLLMEngine
        try:
            return VLLMEngine(cfg.reward_judge_path, dtype=cfg.dtype, seed=cfg.seed + rank,
                              max_model_len=cfg.reward_judge_prompt_length + cfg.reward_judge_max_tokens,
                              kv_cache_gb=cfg.reward_judge_kv_cache_gb,
                              gpu_memory_utilization=cfg.reward_judge_gpu_memory_utilization,
                              enable_sleep_mode=True, distributed=world > 1, eos_token_id=tokenizer.eos_token_id)
        except RuntimeError as e:   # vLLM's reason is on the lines after its error's type
            why = " ".join(line.strip() for line in str(e).splitlines()[:2])
            raise UserError(f"reward_judge_engine=vllm: {why} (what to change: reward_judge_prompt_length + "
                            "reward_judge_max_tokens is its max_model_len; reward_judge_kv_cache_gb (CPU) or "
                            "reward_judge_gpu_memory_utilization (GPU); or reward_judge_engine=hf)") from None
    from transformers import AutoModelForCausalLM

    from modeling.loading import _load
    from rollout.hf import HFEngine
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    model = _load("reward_judge_path", cfg.reward_judge_path, AutoModelForCausalLM.from_pretrained, dtype=dtype)
    model = model.eval().requires_grad_(False).to(device or "cpu")
    return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.rollout_micro_batch_size)
