"""Tools and environments as a user writes them, loaded from "module:name" specs.

A tool is a plain function with type hints and a Google-style docstring; its OpenAI-format schema
comes from transformers' `get_json_schema` (the same one `apply_chat_template(tools=[f])` uses), so
what the model is shown and what we validate calls against cannot drift apart. An environment is a
class with `reset(prompt_row)` and `step(text) -> (observation, reward, done)`.
Every loading failure is a UserError whose one line names the spec.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Protocol, runtime_checkable

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from errors import UserError, first_line


@runtime_checkable
class Environment(Protocol):
    """One instance per trajectory.
    reset(prompt_row) -> None, or the opening messages (a list of chat dicts) to use instead of the
    row's own; step(text of one assistant turn) -> (observation, reward, done) or, gym-style,
    (observation, reward, done, info). observation: a str, a list of str (one tool message each)
    or None; info may carry counts ("tool_calls", "tool_errors") for the metrics."""
    def reset(self, prompt_row: dict) -> list[dict] | None: ...
    def step(self, text: str) -> tuple: ...


def _resolve(spec: str, what: str) -> Any:
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise UserError(f"{what} {spec!r}: expected 'module:name' (e.g. rollout.tools.builtin:calculator)")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{what} {spec!r}: cannot import module {module_name!r} ({first_line(e)})") from None
    except Exception as e:   # the module itself failed while importing
        raise UserError(f"{what} {spec!r}: importing {module_name!r} failed: "
                        f"{type(e).__name__}: {first_line(e)}") from None
    if not hasattr(module, attr):
        raise UserError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def tool_schema(fn: Callable, spec: str | None = None) -> dict:
    """The OpenAI function schema of a typed, documented function (transformers' get_json_schema)."""
    label = spec or getattr(fn, "__name__", repr(fn))
    if not inspect.isfunction(fn):
        raise UserError(f"tool {label!r}: not a function (got {type(fn).__name__}); a tool is a plain "
                        "function with type hints and a docstring")
    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise UserError(f"tool {label!r}: {first_line(e)} (a tool needs type hints and a docstring "
                        "with an Args: line per argument)") from None


def load_tool(spec: str) -> tuple[Callable, dict]:
    fn = _resolve(spec, "tool")
    if not callable(fn):
        raise UserError(f"tool {spec!r}: {type(fn).__name__} is not callable")
    return fn, tool_schema(fn, spec)


def load_environment(spec: str) -> type:
    cls = _resolve(spec, "environment")
    if not inspect.isclass(cls):
        raise UserError(f"environment {spec!r}: not a class (got {type(cls).__name__})")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise UserError(f"environment {spec!r}: class {cls.__name__} has no {' or '.join(missing)} method")
    return cls
