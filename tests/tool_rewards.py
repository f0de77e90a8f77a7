"""The reward of tests/test_tools_train.py's runs: it reads the trajectory's messages."""


def answered(prompts, responses, messages, tool_calls):
    """1 when the last assistant turn answers the question (the reward reads the trajectory's messages)."""
    want = {"What is 6*7?": "42", "Say hi.": "hi"}
    return [float(m[-1]["role"] == "assistant" and want.get(m[0]["content"], "?") in m[-1]["content"])
            for m in messages]


answered.is_verifier = True
