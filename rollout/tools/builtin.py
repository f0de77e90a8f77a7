"""The two built-in tools of the recipes: a calculator (parsed with `ast`, never eval'd) and a Python
executor (a fresh interpreter inside bubblewrap, rollout/tools/sandbox.py, with CPU-time, memory,
process and output limits, every process killed when the call ends).

Config specs: "rollout.tools.builtin:calculator", "rollout.tools.builtin:python".
Both raise ToolError on failure; the tool set turns that into an error observation the model reads.
"""
from __future__ import annotations

import ast
import math
import operator
import os
import json
import select
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rollout.tools.sandbox import SANDBOX_ENV, bwrap_command, no_fork_filter, sandbox_needs_no_fork


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
    timeout_s: float = 10.0            # wall clock; every process of the call is killed after it
    cpu_s: int = 10                    # RLIMIT_CPU: SIGXCPU past it
    memory_mb: int = 512               # RLIMIT_AS: allocations past it raise MemoryError
    max_output_bytes: int = 16_384     # stdout and stderr each, read from pipes; past it the call is stopped
    disk_mb: int = 64                  # the sandbox's tmpfs, its only writable place; RLIMIT_FSIZE too
    processes: int = 64                # RLIMIT_NPROC (per call: counted in the call's own user namespace)


MAX_CODE_BYTES = 100_000   # the code travels as one argument (Linux allows 128 KiB)

# Runs inside the sandbox before the user's code: the code into main.py (for tracebacks with source
# lines), then the limits on itself, which every process it starts inherits and none can raise.
_BOOTSTRAP = r'''
import resource, sys
cpu_s, memory_bytes, file_bytes, processes = (int(a) for a in sys.argv[1:5])
_source = sys.argv[5]
with open("main.py", "w", encoding="utf-8") as f:
    f.write(_source)
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if processes:
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
del resource, f
sys.argv = ["main.py"]
try:
    exec(compile(_source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:   # the traceback from the user's code down, without this file's frame
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
'''


def run_python(code: str, limits: PythonLimits = PythonLimits(), sandbox: str = "bwrap") -> str:
    """Run `code` in a fresh interpreter (inside bubblewrap unless sandbox="none"); its stdout (and
    stderr, when any) as text. Raises ToolError on a timeout, a limit, a signal or an uncaught
    exception (with the traceback)."""
    if not isinstance(code, str):
        raise ToolError("code must be a string")
    if len(code.encode("utf-8", errors="surrogatepass")) > MAX_CODE_BYTES:
        raise ToolError(f"code longer than {MAX_CODE_BYTES} bytes")
    if "\0" in code:
        raise ToolError("code contains a NUL character")
    args = [str(limits.cpu_s), str(limits.memory_mb * 2**20), str(limits.disk_mb * 2**20),
            str(limits.processes if sandbox != "none" else 0), code]
    with tempfile.TemporaryDirectory(prefix="flat_ppo_py_") as tmp:
        outcome = _execute(args, limits, sandbox, tmp)
    returncode, out, err, overflow, timed_out = outcome
    text = out + (f"\n[stderr]\n{err}" if err.strip() else "")
    if overflow:
        raise ToolError(f"output exceeded {limits.max_output_bytes} bytes and the program was stopped\n{text}".rstrip())
    if timed_out:
        raise ToolError(f"timed out after {limits.timeout_s:g} s and was killed\n{text}".rstrip())
    if returncode != 0:
        raise ToolError(f"{_exit_reason(returncode, limits, sandbox)}\n{text}".rstrip())
    return text


def _execute(args: list[str], limits: PythonLimits, sandbox: str, tmp: str):
    """The bootstrap under bwrap (or a plain subprocess in its own session in `tmp`), its output read
    from pipes up to the cap. Every process of the call is gone when this returns."""
    # the short environment for bwrap itself too: the tool's code can read its init's /proc/1/environ
    env = dict(SANDBOX_ENV, HOME=tmp, TMPDIR=tmp) if sandbox == "none" else SANDBOX_ENV
    fds = []
    if sandbox == "none":
        argv = [sys.executable, "-I", "-c", _BOOTSTRAP, *args]
    else:
        info_read, info_write = os.pipe()   # bwrap writes the PID of the namespace's init there
        fds = [info_write]
        program = no_fork_filter() if sandbox_needs_no_fork() else None
        if program is not None:
            fds.append(os.memfd_create("no_fork"))
            os.write(fds[-1], program)
            os.lseek(fds[-1], 0, os.SEEK_SET)
        argv = [*bwrap_command(limits.disk_mb, info_write, fds[1] if program else None), sys.executable, "-I",
                "-c", _BOOTSTRAP, *args]
    try:
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    try:
        out, err, overflow, timed_out = _read_pipes(proc, limits)
    finally:
        if sandbox == "none":   # the session's group is what we can reach
            _kill(lambda: os.killpg(proc.pid, signal.SIGKILL))
        else:   # the init's death ends the PID namespace, and bwrap exits only once it is empty
            init = _read_init_pid(info_read)
            os.close(info_read)
            _kill(lambda: os.kill(init, signal.SIGKILL) if init and proc.poll() is None else None)
            _kill(lambda: proc.wait(timeout=5))
            _kill(proc.kill)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return proc.returncode, out, err, overflow, timed_out


def _read_init_pid(fd: int) -> int | None:
    """bwrap's --info-fd: {"child-pid": N}, written once the sandbox is up (nothing if it never was)."""
    if not select.select([fd], [], [], 0)[0]:
        return None
    try:
        return int(json.loads(os.read(fd, 4096))["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _kill(action) -> None:
    try:
        action()
    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
        pass


def _read_pipes(proc: subprocess.Popen, limits: PythonLimits) -> tuple[str, str, bool, bool]:
    """stdout and stderr until both close (every writer gone) or go quiet after the first process
    ended, the cap is passed or the time is up."""
    deadline = time.monotonic() + limits.timeout_s
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    overflow = timed_out = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and not overflow:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready = selector.select(min(remaining, 0.1))
            for key, _ in ready:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                buffers[key.fd] += chunk
                overflow = overflow or len(buffers[key.fd]) > limits.max_output_bytes
            if not ready and proc.poll() is not None:   # without bwrap a leftover child may hold the pipes
                break
    if not timed_out and not overflow:   # the pipes closed: the first process may still be exiting
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    out, err = (bytes(b[:limits.max_output_bytes]).decode("utf-8", errors="replace") for b in buffers.values())
    return out, err, overflow, timed_out


def _exit_reason(returncode: int, limits: PythonLimits, sandbox: str) -> str:
    """bwrap reports a child killed by signal N as exit status 128+N; a plain subprocess as -N."""
    signum = -returncode if returncode < 0 else returncode - 128 if sandbox != "none" and returncode > 128 else 0
    if signum == signal.SIGXCPU:
        return f"CPU time limit of {limits.cpu_s} s exceeded"
    if signum == signal.SIGXFSZ:
        return f"file size limit of {limits.disk_mb} MB exceeded"
    if signum:
        try:
            return f"killed by signal {signal.Signals(signum).name}"
        except ValueError:
            return f"killed by signal {signum}"
    return f"exit status {returncode}"


def make_python_tool(limits: PythonLimits = PythonLimits(), sandbox: str = "bwrap"):
    """A `python` tool with these limits (e.g. timeout_s from the config's tool_timeout_s) in this
    sandbox (the config's tool_sandbox; check_sandbox at startup says whether it can start)."""
    def python(code: str) -> str:
        """Run a Python program and return what it prints. Each call starts a fresh interpreter with no network; print the values you need.

        Args:
            code: The complete program, e.g. "print(sum(range(10)))".
        """
        return run_python(code, limits, sandbox)
    python.own_timeout_s = limits.timeout_s   # the tool set's own timer waits a little longer (toolset.py)
    python.sandbox = sandbox
    return python


python = make_python_tool()
