"""The Hydra overrides of a verl launch script's `main_ppo` command, read as bash would run it.

verl users keep their settings in shell scripts: `python3 -m verl.trainer.main_ppo \\` followed by
key=value lines, with shell variables set earlier in the script. This reads such a script without
running it: backslash line continuations are joined, comments dropped, words split with the shell's
quoting rules, and `$VAR`, `${VAR}`, `${VAR:-default}` (also `${VAR-default}`, `${VAR:=default}`) and
`"${ARRAY[@]}"` resolved from the assignments earlier in the script (`NAME=value`, `export NAME=value`,
`NAME=(a b c)`) and then the environment. `$@` / `"$@"` (the script's own arguments) stand for the
key=value arguments given to the translator after the script.

A reference that cannot be resolved (an unset variable, `$1`, `$(command)`) is never replaced by a
guess or by its literal text: the override that holds it is returned as unresolved, with the names.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from errors import UserError


@dataclasses.dataclass
class LaunchScript:
    overrides: list      # key=value (or ~key, +key=value) words of the main_ppo command, resolved, in order
    unresolved: list     # (key, the word as written, [the references it could not resolve])
    notes: list          # what else the reader should know (several main_ppo commands, Hydra options, ...)
    line: int = 0        # the line the main_ppo command starts on


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.S)
_MARK = "\x02"          # unresolved reference i is written \x02i\x02 until the words are split
_PASS = "\x03"          # "$@": the translator's own key=value arguments go there
_OPERATORS = {";", "&", "&&", "|", "||", "|&", ";;", "(", ")", "!"}


class _Expander:
    """Expands one script's parameters as it goes, keeping the references it cannot resolve."""

    def __init__(self, env: dict):
        self.vars: dict = dict(env)     # name -> str, or list for an array; assignments override
        self.refs: list = []            # the text of each unresolved reference, by marker index

    def unresolved(self, text: str) -> str:
        self.refs.append(text)
        return f"{_MARK}{len(self.refs) - 1}{_MARK}"

    def braced(self, body: str) -> str | list:
        """The value of ${body}: a string, or a list for ${ARRAY[@]}."""
        if body in ("@", "*"):
            return _PASS
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]", body)
        if m:
            value = self.vars.get(m.group(1))
            if value is None:
                return self.unresolved("${" + body + "}")
            return value if isinstance(value, list) else [value]
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-=])(.*))?", body, re.S)
        if not m:                                       # ${#x}, ${x/a/b}, ${x%.*}, ...: not evaluated here
            return self.unresolved("${" + body + "}")
        name, op, default = m.groups()
        value = self.vars.get(name)
        if isinstance(value, list):
            value = value[0] if value else ""
        if op and (value is None or (op.startswith(":") and value == "")):
            value = self.plain(_unquoted(default.strip()))
            if op.endswith("="):
                self.vars[name] = value
        return self.unresolved("${" + body + "}") if value is None else value

    def plain(self, text: str) -> str:
        """$-expansion of a default's text (no quote removal there: defaults are single words)."""
        out, i = [], 0
        while i < len(text):
            if text[i] == "$":
                value, i = self.reference(text, i)
                out.append(" ".join(value) if isinstance(value, list) else value)
            else:
                out.append(text[i])
                i += 1
        return "".join(out)

    def reference(self, text: str, i: int):
        """(value, index after it) for the reference at text[i] == '$'."""
        nxt = text[i + 1:i + 2]
        if nxt == "{":
            end = _closing(text, i + 2, "{", "}")
            return self.braced(text[i + 2:end]), end + 1
        if nxt == "(":                                  # $(command) and $((arithmetic)): not run here
            end = _closing(text, i + 2, "(", ")")
            return self.unresolved(text[i:end + 1]), end + 1
        if nxt in ("@", "*"):
            return _PASS, i + 2
        if nxt and (nxt.isdigit() or nxt in "#?$!-"):   # positional and special parameters: unknown here
            return self.unresolved(text[i:i + 2]), i + 2
        m = _NAME.match(text, i + 1)
        if not m:
            return "$", i + 1                           # a lone $ is itself
        value = self.vars.get(m.group(0))
        if isinstance(value, list):
            value = value[0] if value else ""
        return (self.unresolved(text[i:m.end()]) if value is None else value), m.end()


def _unquoted(text: str) -> str:
    """A default written in quotes, ${X:-'a b'}, without them."""
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else text


def _closing(text: str, start: int, open_: str, close: str) -> int:
    """The index of the bracket that closes the one opened just before text[start]."""
    depth = 1
    for j in range(start, len(text)):
        depth += (text[j] == open_) - (text[j] == close)
        if depth == 0:
            return j
    raise UserError(f"an unclosed {open_!r} in: {text[start - 2:start + 40]!r}")


def _logical_lines(text: str):
    """(first line number, text, cut) of each command line: continuations joined, comments dropped, the
    lines of an unclosed ( ... ) (an array, a subshell) kept together, as bash reads them. cut: the line
    number of a comment ending in a backslash that ended this line (bash does not continue a comment),
    else 0."""
    out, start, line = [], 1, 1
    single = double = comment = False
    depth, i = 0, 0
    while i < len(text):
        c = text[i]
        if c == "\n":
            line += 1
        if comment:
            if c == "\n":
                comment = False
                if depth == 0:
                    yield start, "".join(out), (line - 1 if text[i - 1] == "\\" and out else 0)
                    out, start = [], line
                else:
                    out.append(" ")
            i += 1
            continue
        if c == "\\" and not single and text[i + 1:i + 2] == "\n":
            i, line = i + 2, line + 1                   # a line continuation: both characters go
            continue
        if c == "\\" and not single:
            out.append(text[i:i + 2])
            i += 2
            continue
        if c == "'" and not double:
            single = not single
        elif c == '"' and not single:
            double = not double
        elif not (single or double):
            if c == "#" and (not out or out[-1][-1:] in " \t;&|()"):
                comment = True
                i += 1
                continue
            depth = max(0, depth + (c == "(") - (c == ")"))
            if c == "\n":
                if depth == 0:
                    yield start, "".join(out), 0
                    out, start = [], line
                else:
                    out.append(" ")
                i += 1
                continue
        out.append(c)
        i += 1
    yield start, "".join(out), 0


def _expand(line: str, ex: _Expander) -> str:
    """The line with every $ reference outside single quotes replaced by its value, quoted so that the
    word splitting that follows keeps each value as it is (a list: one word per element)."""
    out, i, single, double = [], 0, False, False
    while i < len(line):
        c = line[i]
        if c == "\\" and not single:
            out.append(line[i:i + 2])
            i += 2
            continue
        if c == "'" and not double:
            single = not single
        elif c == '"' and not single:
            double = not double
        elif c == "`" and not single:                   # `command`: not run here
            end = line.find("`", i + 1)
            end = len(line) - 1 if end < 0 else end
            out.append(ex.unresolved(line[i:end + 1]))
            i = end + 1
            continue
        elif c == "$" and not single:
            value, i = ex.reference(line, i)
            values = value if isinstance(value, list) else [value]
            if double:
                out.append('" "'.join(v.replace("\\", "\\\\").replace('"', '\\"') for v in values))
            else:
                out.append(" ".join(shlex.quote(v) if v else "" for v in values))
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _commands(words: list):
    """The simple commands of one line's words: split at ; & && | ||, redirections dropped, an
    array assignment NAME=( ... ) kept as one word (NAME, [elements])."""
    cmd, i = [], 0
    while i < len(words):
        w = words[i]
        if w.endswith("=") and _ASSIGN.fullmatch(w) and words[i + 1:i + 2] == ["("]:
            end = words.index(")", i + 2) if ")" in words[i + 2:] else len(words)
            cmd.append((w[:-1], words[i + 2:end]))
            i = end + 1
            continue
        if w in _OPERATORS:
            if cmd:
                yield cmd
            cmd = []
        elif re.fullmatch(r"[&0-9]*[<>][<>&|]*", w):    # 2>&1, > log, < in: the target word goes too
            if cmd and isinstance(cmd[-1], str) and cmd[-1].isdigit():
                cmd.pop()
            i += 1
        else:
            cmd.append(w)
        i += 1
    if cmd:
        yield cmd


def _is_main_ppo(words: list, j: int) -> bool:
    w = words[j]
    return w.endswith("main_ppo.py") or (w.endswith("main_ppo") and j > 0 and words[j - 1] == "-m")


_HYDRA_OPTIONS = ("--config-path", "--config-name", "--config-dir", "-cp", "-cn", "-cd")


def read_launch_script(path: str, env: dict) -> LaunchScript:
    """The overrides of the first main_ppo command in the script at `path`, variables resolved from the
    script's earlier assignments and then `env`."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such launch script")
    ex, found = _Expander(env), []
    for lineno, line, cut in _logical_lines(file.read_text()):
        try:
            words = shlex.shlex(_expand(line, ex), posix=True, punctuation_chars=True)
            words.whitespace_split = True
            words = list(words)
        except ValueError as e:                         # an unclosed quote
            raise UserError(f"{path}, line {lineno}: {e}") from None
        for cmd in _commands(words):
            if cmd[0] in ("export", "declare", "readonly", "local", "typeset"):
                cmd = [w for w in cmd[1:] if not (isinstance(w, str) and w.startswith("-"))]
            assigns = [w for w in cmd if isinstance(w, tuple) or _ASSIGN.fullmatch(w)]
            if len(assigns) == len(cmd):                # NAME=value ...: the script's own variables
                for w in assigns:
                    name, value = w if isinstance(w, tuple) else _ASSIGN.fullmatch(w).groups()
                    ex.vars[name] = value
                continue
            words = [w for w in cmd[len(assigns):] if isinstance(w, str)]   # VAR=x cmd: for cmd only
            at = next((j for j in range(len(words)) if _is_main_ppo(words, j)), None)
            if at is not None:
                found.append((lineno, words[at + 1:], cut))
    if not found:
        raise UserError(f"{path}: no `python3 -m verl.trainer.main_ppo` (or main_ppo.py) command in it")
    lineno, args, cut = found[0]
    script = _arguments(args, ex.refs)
    script.line = lineno
    if cut:
        script.notes.insert(0, f"line {cut}: a comment ending in a backslash ends the main_ppo command there; "
                               f"bash runs the lines after it as another command, and so does this")
    if len(found) > 1:
        script.notes.insert(0, f"the script runs main_ppo {len(found)} times (lines "
                               f"{', '.join(str(n) for n, *_ in found)}); translated the first, line {lineno}")
    return script


def _arguments(args: list, refs: list) -> LaunchScript:
    """The main_ppo command's words sorted into overrides, unresolved overrides and notes."""
    script = LaunchScript([], [], [])
    shown = lambda w: re.sub(f"{_MARK}(\\d+){_MARK}", lambda m: refs[int(m.group(1))], w)  # noqa: E731
    skip = False
    for w in args:
        if skip:
            skip = False
            continue
        if _PASS in w:
            script.notes.append("the script passes its own arguments on ($@): give them after the script here")
            w = w.replace(_PASS, "")
            if not w:
                continue
        if w.split("=", 1)[0] in _HYDRA_OPTIONS:
            skip = "=" not in w
            script.notes.append(f"Hydra option {shown(w)}: the base config it names is not read (pass that YAML "
                                f"with --verl_config); only the overrides are translated")
        elif w.startswith("-"):
            script.notes.append(f"{shown(w)}: a command-line option, not an override; skipped")
        elif _MARK in w:
            names = [refs[int(i)] for i in re.findall(f"{_MARK}(\\d+){_MARK}", w)]
            script.unresolved.append((shown(w).split("=", 1)[0].lstrip("+~"), shown(w), names))
            script.overrides.append("~" + w.split("=", 1)[0].lstrip("+~"))   # its value is unknown: nothing
            # an earlier override gave that key is carried either (verl would use this one)
        elif "=" in w or w.startswith("~"):
            script.overrides.append(w)
        else:
            script.notes.append(f"{shown(w)!r}: not key=value; skipped")
    return script
