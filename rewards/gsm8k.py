"""GSM8K verifier: 1.0 when the response's final number equals the problem's ground truth, else 0.0.

    reward_fn: rewards.gsm8k:compute_score            # strict: the answer must follow "####"
    reward_fn: rewards.gsm8k:compute_score_flexible   # flexible: the last number in the response

The data comes from scripts/prepare_gsm8k.py, whose prompts ask the model to "output the final answer
after '####'" and whose `ground_truth` column holds the reference number (GSM8K's answer after "####",
commas removed).

Calling convention: fn(prompts, responses, ground_truth) -> list[float]. The first two are the
trainer's usual arguments; `ground_truth` is one entry per sample, taken from the dataset's
`ground_truth` column. A reward function's parameters after (prompts, responses) name the dataset
columns it needs, and the trainer passes each such column for the samples it scores. The
ground truth cannot be recovered from the prompt text, so calling without it is an error, not a
zero score (which would train on garbage).

Both functions are verifiers (`is_verifier = True`): the trainer logs reward/accuracy, the fraction
of samples scoring >= 1.0.

Compared with verl's gsm8k scorer (verl/utils/reward_score/gsm8k.py, score 1.0, format_score 0.0):
the same two modes, the same "last match wins" rule, and the same 0.0 for a missing or wrong answer,
but numbers are compared after normalisation on both sides ("1,234", "$1234", "+1234", "1234.0" and
"1234." all equal "1234"; verl only strips commas and "$", so "72." or "72.0" score 0 there), and the
whole response is searched (verl looks at its last 300 characters only).
"""

import re
from decimal import Decimal, InvalidOperation

# A number as written in a solution: optional sign, optional "$", digits with optional thousands
# commas ("1,234"; "1,2" is two numbers), optional decimals. A trailing "." (end of a sentence) is
# not part of it.
_NUMBER = r"[-+]?\$?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + r")")
_FLEXIBLE = re.compile(_NUMBER)


def normalize_number(text: str) -> str | None:
    """Canonical decimal form of a written number ("$1,234.0" -> "1234", "+0.50" -> "0.5"), or None."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))                      # "72.0" -> "72", "-0" -> "0"
    return format(value.normalize(), "f")          # "0.50" -> "0.5", never "5E-1"


def extract_answer(response: str, method: str = "strict") -> str | None:
    """The response's final answer, normalised; None when there is none.

    strict: the number after the last "####" that has one ("#### 72", "####72", "#### $1,234").
    flexible: the last number anywhere in the response.
    """
    if method == "strict":
        matches = _STRICT.findall(response)
    elif method == "flexible":
        matches = _FLEXIBLE.findall(response)
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    return normalize_number(matches[-1]) if matches else None


def _scores(prompts, responses, ground_truth, method: str) -> list[float]:
    if ground_truth is None:
        raise ValueError("rewards.gsm8k needs the dataset's ground_truth column, passed as "
                         "fn(prompts, responses, ground_truth=[...]); write the data with "
                         "scripts/prepare_gsm8k.py, whose files have that column")
    if not (len(prompts) == len(responses) == len(ground_truth)):
        raise ValueError(f"got {len(prompts)} prompts, {len(responses)} responses and "
                         f"{len(ground_truth)} ground truths; they must be one per sample")
    scores = []
    for i, (response, truth) in enumerate(zip(responses, ground_truth)):
        expected = normalize_number(str(truth))
        if expected is None:
            # A reference we cannot read is a data bug; scoring every answer 0 would hide it.
            raise ValueError(f"sample {i}: ground truth {truth!r} is not a number")
        scores.append(1.0 if extract_answer(response, method) == expected else 0.0)
    return scores


def compute_score(prompts: list[str], responses: list[str], ground_truth: list[str] | None = None) -> list[float]:
    """Strict: 1.0 where the number after the last "####" equals the ground truth, else 0.0."""
    return _scores(prompts, responses, ground_truth, "strict")


def compute_score_flexible(prompts: list[str], responses: list[str],
                           ground_truth: list[str] | None = None) -> list[float]:
    """Flexible: 1.0 where the last number in the response equals the ground truth, else 0.0."""
    return _scores(prompts, responses, ground_truth, "flexible")


compute_score.is_verifier = True
compute_score_flexible.is_verifier = True


def compute_score_final_turn(prompts: list[str], responses: list[str], ground_truth: list[str] | None = None,
                             messages: list[list[dict]] | None = None) -> list[float]:
    """Multi-turn (tools): strict, on the final assistant turn only. `responses` then holds the tool
    output too, so a program that prints "#### 72" would score by itself, even in a trajectory cut off
    before the model answered; a trajectory that does not end on an assistant turn scores 0."""
    if messages is None:
        raise ValueError("compute_score_final_turn reads the conversation: use it with tools or an environment")
    finals = [m[-1]["content"] if m and m[-1]["role"] == "assistant" else "" for m in messages]
    return _scores(prompts, finals, ground_truth, "strict")


compute_score_final_turn.is_verifier = True
