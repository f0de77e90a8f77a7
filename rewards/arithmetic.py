"""Rule-based verifier for the demo's arithmetic task ("47+38=" -> "85").

Use as `reward_fn: rewards.arithmetic:compute_score`. The score is 0/1, so the trainer can also log
reward/accuracy (the fraction of samples scoring >= 1.0), which it does for functions marked
`is_verifier`.
"""

import re

# "A+B=", "A-B=", "A*B=": integers (a leading minus allowed), spaces anywhere around the parts.
_PROMPT = re.compile(r"\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _expected(prompt: str) -> int:
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        # A prompt we cannot read is a data bug; scoring it 0 would silently train on garbage.
        raise ValueError(f"cannot parse arithmetic prompt {prompt!r}; expected e.g. '47+38='")
    a, op, b = match.groups()
    return _OPS[op](int(a), int(b))


def compute_score(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the response is exactly the prompt's integer result, else 0.0.

    The response is stripped of surrounding whitespace and cut at its first newline, so a model
    that keeps writing on the next line is judged on its first line only. "Exactly" means the
    canonical decimal form: "085", "+85" or "85.0" score 0, so PPO cannot be rewarded for
    padding its answers.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    scores = []
    for prompt, response in zip(prompts, responses):
        answer = response.strip().split("\n", 1)[0].strip()
        scores.append(1.0 if answer == str(_expected(prompt)) else 0.0)
    return scores


compute_score.is_verifier = True


def final_answer_score(prompts: list[str], responses: list[str], messages: list[list[dict]]) -> list[float]:
    """Multi-turn (tools): 1.0 where the last number of the final assistant turn is the result of
    the first user message's "A*B=" problem, else 0.0 (a trajectory that ends on a tool call or is
    cut off scores 0). Takes `messages`, the conversation, which multi-turn rollouts provide."""
    scores = []
    for conversation in messages:
        question = next(m["content"] for m in conversation if m["role"] == "user")
        last = conversation[-1]["content"] if conversation[-1]["role"] == "assistant" else ""
        numbers = re.findall(r"-?\d+", last.split("</tool_call>")[-1])
        scores.append(1.0 if numbers and int(numbers[-1]) == _expected(question) else 0.0)
    return scores


final_answer_score.is_verifier = True
