"""The one error type for bad input (config, data, files, reward), shared by train_ppo.py and the
modules beside it: the script reports it as one line naming the culprit, without a traceback."""


class UserError(Exception):
    """Bad input: reported as one clear line, no traceback."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (libraries often add paragraphs), or its type."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
