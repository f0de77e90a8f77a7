"""--help and the docs' config reference (scripts/config_reference.py), both rendered from
config.py's Config dataclass: its fields' types, defaults and one-line helps, grouped under the
`# section` comments of its source. One source, so they cannot drift.
"""
import dataclasses
import inspect
import os
import re
import typing
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]   # the repository root


def sections(config) -> list[tuple[str, list]]:
    """The config class's fields grouped under the `# section` comments of its source, in order."""
    fields, found = {f.name: f for f in dataclasses.fields(config)}, []
    for line in inspect.getsource(config).splitlines():
        if line.startswith("    # "):
            found.append((line.strip()[2:], []))
        elif (m := re.match(r"    (\w+):", line)) and m.group(1) in fields:
            found[-1][1].append(fields[m.group(1)])
    return found


def key_type(config, f) -> str:
    kind = typing.get_type_hints(config)[f.name]
    if typing.get_origin(kind) is typing.Union:
        return " | ".join("None" if a is type(None) else a.__name__ for a in typing.get_args(kind))
    return kind.__name__


def key_default(f) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default   # a dict-valued key's
    if isinstance(value, str) and value.startswith(str(HERE)):
        value = os.path.relpath(value, HERE)   # the demo's files, shipped next to train_ppo.py
    return repr(value) if isinstance(value, str) else str(value)


def help_text(config) -> str:
    lines = ["usage: train_ppo.py [--config FILE.yaml ...] [--key=value ...]",
             "Later --config files override earlier ones; --key=value overrides them all.", ""]
    for section, fields in sections(config):
        lines.append(f"{section}:")
        for f in fields:
            lines.append(f"  --{f.name} {key_type(config, f)} (default {key_default(f)})")
            lines.append(f"      {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)
