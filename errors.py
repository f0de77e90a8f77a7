"""The one error type for bad input (config, data, files, reward), shared by train_ppo.py and the
modules beside it: the script reports it as one line naming the culprit, without a traceback."""


class UserError(Exception):
    """Bad input: reported as one clear line, no traceback."""
