"""The two built-in tools of the recipes: a calculator (parsed with `ast`, never eval'd) and a Python
executor (a subprocess with CPU-time, memory and output limits, no network, killed on timeout).

Config specs: "rollout.tools.builtin:calculator", "rollout.tools.builtin:python".
Both raise ToolError on failure; the tool set turns that into an error observation the model reads.
"""
from __future__ import annotations

import ast
import functools
import math
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


class ToolError(Exception):
    """A tool's own, expected failure: its message is what the model sees after "error: "."""


# ---------------------------------------------------------------------------------------------
# calculator

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096          # bounds every intermediate integer: 10**1233 fits, 10**10**10 never starts
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12+7)*3**2".
    """
    if not isinstance(expression, str):
        raise ToolError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"not an arithmetic expression ({type(e).__name__})") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, RecursionError):
        raise ToolError("result too large") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):   # not bool, complex, str
        _check_int(node.value)
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        elif isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
                raise ToolError(f"result larger than {MAX_INT_BITS} bits")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):      # (-8) ** 0.5
            raise ToolError("result is not a real number")
        _check_int(value)
        return value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("'^' is not a power here: use **")
    what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__
    raise ToolError(f"{what} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_int(value) -> None:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"number larger than {MAX_INT_BITS} bits")


def _check_power(base, exponent) -> None:
    """Refuse before computing: 9**9**9 would take minutes and gigabytes."""
    if abs(exponent) > 100_000:
        raise ToolError("exponent too large")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) > MAX_INT_BITS:
            raise ToolError(f"result larger than {MAX_INT_BITS} bits")


# ---------------------------------------------------------------------------------------------
# Python executor

@dataclass(frozen=True)
class PythonLimits:
    timeout_s: float = 10.0            # wall clock; the whole process group is killed after it
    cpu_s: int = 10                    # RLIMIT_CPU: SIGXCPU past it
    memory_mb: int = 512               # RLIMIT_AS: allocations past it raise MemoryError
    max_output_bytes: int = 16_384     # RLIMIT_FSIZE on the stdout/stderr files: writes past it fail


# Runs inside the child before the user's code: limits on itself (resource.setrlimit in the child,
# not a preexec_fn, which may deadlock when the parent has threads, as the tool pool does), then an
# audit hook that refuses sockets and new processes. The hook cannot be removed once added;
# it is not a security boundary against hostile code (the network namespace below is the stronger
# part), it keeps well-meaning model code off the network and inside the group we kill.
_BOOTSTRAP = r'''
import resource, sys
cpu_s, memory_bytes, output_bytes = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.")
def _audit(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"{event} is not allowed in this sandbox (no network, no subprocesses)")
sys.addaudithook(_audit)
del resource, _audit
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as f:
    _source = f.read()
try:
    exec(compile(_source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:   # the traceback from the user's code down, without this file's frame
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
'''


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """`unshare --user --map-root-user --net`: the child gets a network namespace with no
    interfaces (loopback down), so even code past the audit hook has no network. Used when the
    kernel allows unprivileged user namespaces; otherwise only the audit hook stands."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--user", "--map-root-user", "--net", "--")
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else ()


def run_python(code: str, limits: PythonLimits = PythonLimits()) -> str:
    """Run `code` in a fresh interpreter; its stdout (and stderr, when any) as text.
    Raises ToolError on a timeout, a limit, or an uncaught exception (with the traceback)."""
    if not isinstance(code, str):
        raise ToolError("code must be a string")
    with tempfile.TemporaryDirectory(prefix="flat_ppo_py_") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code, encoding="utf-8")
        (work / "bootstrap.py").write_text(_BOOTSTRAP, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
               "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        argv = [*network_namespace_prefix(), sys.executable, "-I", "bootstrap.py",
                str(limits.cpu_s), str(limits.memory_mb * 2**20), str(limits.max_output_bytes)]
        with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
            proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)   # its own process group: killpg reaches children
            try:
                proc.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)   # the leader is alive (not reaped): the group is ours
                proc.wait()
        stdout, out_full = _read_capped(work / "stdout", limits.max_output_bytes)
        stderr, err_full = _read_capped(work / "stderr", limits.max_output_bytes)
    text = stdout + (f"\n[stderr]\n{stderr}" if stderr.strip() else "")
    if out_full or err_full:
        text += f"\n[output truncated at {limits.max_output_bytes} bytes]"
    if timed_out:
        raise ToolError(f"timed out after {limits.timeout_s:g} s and was killed\n{text}".rstrip())
    if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
        raise ToolError(f"CPU time limit of {limits.cpu_s} s exceeded\n{text}".rstrip())
    if proc.returncode != 0:
        raise ToolError(f"exit status {proc.returncode}\n{text}".rstrip())
    return text


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) >= cap


def make_python_tool(limits: PythonLimits = PythonLimits()):
    """A `python` tool with these limits (e.g. timeout_s from the config's tool_timeout_s)."""
    def python(code: str) -> str:
        """Run a Python program and return what it prints. Each call starts a fresh interpreter with no network; print the values you need.

        Args:
            code: The complete program, e.g. "print(sum(range(10)))".
        """
        return run_python(code, limits)
    python.own_timeout_s = limits.timeout_s   # the tool set's own timer waits a little longer (toolset.py)
    return python


python = make_python_tool()
