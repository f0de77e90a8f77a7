"""The function a "module:function" config key names (reward_fn, reward_judge_parser), imported
from this repository or PYTHONPATH, with one-line errors that name the key."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from errors import UserError, first_line

ROOT = Path(__file__).resolve().parents[1]


def load_function(spec: str, key: str = "reward_fn"):
    """The function a "module:function" key names (reward_fn, reward_judge_parser), or a UserError
    naming the key, the module and what went wrong."""
    if ":" not in spec:
        raise UserError(f"{key} must look like 'module:function', got {spec!r}")
    module, name = spec.split(":", 1)
    sys.path.insert(0, str(ROOT))   # rewards/ ships in the repository root
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise UserError(f"{key} {spec!r}: no module named {e.name!r} on the Python path (this repository and "
                            f"PYTHONPATH): add the module's directory to PYTHONPATH") from None
        raise UserError(f"{key} {spec!r}: importing {module} raised {_raised_at(e, module)}") from None
    except Exception as e:   # the user's code runs at import: a SyntaxError, or anything it raises
        raise UserError(f"{key} {spec!r}: importing {module} raised {_raised_at(e, module)}") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise UserError(f"{key} {spec!r}: module {module} ({getattr(mod, '__file__', '?')}) has no {name!r}")
    if not callable(fn):
        raise UserError(f"{key} {spec!r}: {module}.{name} = {fn!r:.40} is not a function")
    return fn


def _raised_at(e: BaseException, module: str) -> str:
    """'Type: message (file, line N)': where the import raised, in the module's own file if it
    appears in the traceback (else the innermost frame)."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    own = module.replace(".", os.sep)
    mine = [f for f in frames if f.filename.endswith((own + ".py", os.path.join(own, "__init__.py")))]
    at = (mine or frames)[-1:]
    return f"{type(e).__name__}: {first_line(e)}" + (f" ({at[0].filename}, line {at[0].lineno})" if at else "")
