"""Tool calls in model text, in the Hermes / Qwen2.5 format that Qwen2.5's chat template teaches:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "6*7"}}
    </tool_call>

Strict on purpose: a call the template would not have rendered (unclosed or nested tags, a body
that is not one JSON object with exactly "name" and "arguments", arguments that are not an
object) is a MalformedCall, which becomes an error observation and is counted, rather than a guess.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(re.escape(OPEN) + "|" + re.escape(CLOSE))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class MalformedCall:
    error: str          # what is wrong, shown to the model
    raw: str            # the offending text


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every <tool_call> block of one assistant turn, in order; [] when it calls nothing."""
    calls: list[ToolCall | MalformedCall] = []
    open_at = None                                   # end of the current <tool_call>, when inside one
    for tag in _TAG.finditer(text):
        if tag.group() == OPEN:
            if open_at is not None:
                calls.append(MalformedCall(f"{OPEN} inside another {OPEN}", text[open_at:tag.start()]))
            open_at = tag.end()
        elif open_at is None:
            calls.append(MalformedCall(f"{CLOSE} without {OPEN}", text[max(0, tag.start() - 80):tag.end()]))
        else:
            calls.append(_parse_body(text[open_at:tag.start()]))
            open_at = None
    if open_at is not None:
        calls.append(MalformedCall(f"{OPEN} without {CLOSE}", text[open_at:]))
    return calls


def _parse_body(body: str) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(f"tool call is not valid JSON ({e.msg} at character {e.pos})", body)
    if not isinstance(obj, dict):
        return MalformedCall('tool call must be a JSON object {"name": ..., "arguments": {...}}', body)
    keys = set(obj)
    if keys != {"name", "arguments"}:
        wrong = sorted(keys ^ {"name", "arguments"})
        return MalformedCall(f'tool call must have exactly the keys "name" and "arguments" (check: {", ".join(wrong)})', body)
    if not isinstance(obj["name"], str) or not obj["name"]:
        return MalformedCall('"name" must be a non-empty string', body)
    if not isinstance(obj["arguments"], dict):
        return MalformedCall('"arguments" must be a JSON object', body)
    return ToolCall(obj["name"], obj["arguments"])
