"""The reward of tests/test_tools_train.py's runs: it reads the trajectory's messages; and a calculator
that logs its calls."""
import functools
import os

from rollout.tools.builtin import calculator as _builtin_calculator


def answered(prompts, responses, messages, tool_calls):
    """1 when the last assistant turn answers the question (the reward reads the trajectory's messages)."""
    want = {"What is 6*7?": "42", "Say hi.": "hi"}
    return [float(m[-1]["role"] == "assistant" and want.get(m[0]["content"], "?") in m[-1]["content"])
            for m in messages]


answered.is_verifier = True


@functools.wraps(_builtin_calculator)
def calculator(expression: str) -> str:
    """The built-in calculator (the same schema, so the memorised model calls it), each call written as a
    line "<pid> <expression>" to the file TOOL_CALL_LOG names: where the calls ran, and how many."""
    with open(os.environ["TOOL_CALL_LOG"], "a") as log:
        log.write(f"{os.getpid()} {expression}\n")
    return _builtin_calculator(expression)
