"""A set of tools: validates a parsed call against the tool's schema, runs it with a wall-clock
limit, and turns every outcome into observation text. A tool that raises, hangs or returns something
that is not text is an error observation ("error: ..."), counted, never an exception out of here."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Callable

from errors import UserError
from rollout.tools.builtin import ToolError
from rollout.tools.parsing import MalformedCall, ToolCall
from rollout.tools.spec import load_tool, tool_schema

# JSON schema type -> the Python values that satisfy it (bool is an int in Python, not in JSON)
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


@dataclass(frozen=True)
class ToolResult:
    text: str           # what the model reads in the tool message
    ok: bool            # False: an error observation (counted in tools/error_rate)


class ToolSet:
    def __init__(self, functions: list[Callable], timeout_s: float = 30.0, max_observation_chars: int = 8192):
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []                # OpenAI function format, for apply_chat_template(tools=...)
        for fn in functions:
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self.functions:
                raise UserError(f"two tools are named {name!r}: tool names must be unique")
            self.functions[name] = fn
            self.schemas.append(schema)
        self.timeout_s = timeout_s
        self.max_observation_chars = max_observation_chars

    @classmethod
    def from_specs(cls, specs: list[str], **kw) -> "ToolSet":
        return cls([load_tool(spec)[0] for spec in specs], **kw)

    def run(self, call: ToolCall | MalformedCall) -> ToolResult:
        if isinstance(call, MalformedCall):
            return _error(f"malformed tool call: {call.error}")
        fn = self.functions.get(call.name)
        if fn is None:
            return _error(f"unknown tool {call.name!r}; available: {', '.join(self.functions)}")
        problem = self._check_arguments(call)
        if problem:
            return _error(f"{call.name}: {problem}")
        # a tool that stops itself (the python executor kills its subprocess) gets a margin, so that its own
        # message, the same every time, is the one the model reads, not whichever timer fired first
        limit = fn.own_timeout_s + 5.0 if hasattr(fn, "own_timeout_s") else self.timeout_s
        outcome = _call_with_timeout(fn, call.arguments, limit)
        if isinstance(outcome, _Failed):
            return self._capped(_error(f"{call.name}: {outcome.message}"))
        text = _as_text(outcome)
        if text is None:
            return _error(f"{call.name} returned {type(outcome).__name__}, not text")
        return self._capped(ToolResult(text, True))

    def _capped(self, result: ToolResult) -> ToolResult:
        """A result or an error (a traceback, the output before a limit) at most max_observation_chars."""
        if len(result.text) <= self.max_observation_chars:
            return result
        return ToolResult(result.text[:self.max_observation_chars]
                          + f"\n[truncated at {self.max_observation_chars} characters]", result.ok)

    def _check_arguments(self, call: ToolCall) -> str | None:
        params = next(s for s in self.schemas if s["function"]["name"] == call.name)["function"]["parameters"]
        properties = params.get("properties", {})
        unknown = sorted(set(call.arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; expected: {', '.join(properties) or 'none'}"
        missing = [p for p in params.get("required", []) if p not in call.arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        for name, value in call.arguments.items():
            expected = properties[name].get("type")
            allowed = expected if isinstance(expected, list) else [expected] if expected else []
            if allowed and not any(t in _JSON_TYPES and isinstance(value, _JSON_TYPES[t])
                                   and not (isinstance(value, bool) and t in ("integer", "number"))
                                   for t in allowed):
                return f"argument {name!r} must be {' or '.join(allowed)}, got {type(value).__name__}"
        return None


def _error(message: str) -> ToolResult:
    return ToolResult(f"error: {message}", False)


@dataclass
class _Failed:
    message: str


def _call_with_timeout(fn: Callable, arguments: dict, timeout_s: float):
    """The tool in a daemon thread, waited on for timeout_s. A Python thread cannot be killed: a
    tool that hangs past its limit is abandoned (it ends with the process); tools that can hang on
    purpose (the Python executor) enforce their own limit and kill their subprocess."""
    box: list = []

    def target():
        try:
            box.append(fn(**arguments))
        except ToolError as e:
            box.append(_Failed(str(e)))
        except BaseException as e:   # the tool's bug, not ours: the model sees it, the run goes on
            box.append(_Failed(f"{type(e).__name__}: {e}"))

    thread = threading.Thread(target=target, daemon=True, name="tool-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return _Failed(f"timed out after {timeout_s:g} s")
    return box[0]


def _as_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            return None
    return None
