"""The tests' Python processes (train_ppo.py runs, their accelerate launches and ranks, driver
scripts) started warm: forked from a server that has already imported the heavy libraries
(torch, transformers, DeepSpeed, Accelerate, MLflow, matplotlib). A fresh interpreter spends most
of a short test run importing them (about 9 of a 1-step run's 13 s on 2 cores); a forked child
starts with them in memory and runs the real script with the real libraries from its first line.

- `command(cmd)` rewrites `[sys.executable, script.py | -m module, ...]` into the same command
  through tests/warm_python, and an `accelerate launch` so that its ranks start through it too
  (`--no_python warm_python script.py`): torch's elastic agent still starts, watches and stops
  every rank. `run` and `Popen` are subprocess's with that command.
- warm_python hands the server its argv, working directory, environment and stdio descriptors;
  the child takes them all (and `sys.path` as a fresh interpreter builds it: the script's folder,
  then $PYTHONPATH, then the site folders; a sitecustomize.py on $PYTHONPATH is imported), runs
  the command, and ends as an interpreter does (threads joined, atexit handlers, the exit status;
  an uncaught exception's traceback and status 1). Signals sent to warm_python reach the child;
  if warm_python is killed, the child kills itself.
- The server imports third-party libraries only: the repository's modules are imported by each
  child after its environment is set, as in a fresh run.
- One server per pytest process (conftest starts it; FLAT_PPO_TESTS_FRESH=1 keeps every command
  fresh), and a second one that has vLLM imported too, started when the first command that names
  vLLM comes (`names_vllm`: `--rollout_engine=vllm`, the vLLM scripts): vLLM's import is 3-5 s of
  each such process. It hides Triton before importing anything else, as train_ppo.py's
  lean_imports does (vLLM then sees what it sees in a run). Commands that do not name vLLM never
  start in a process that has imported it, nor do those with a sitecustomize.py on $PYTHONPATH
  (it may hook vLLM's import: the fault-injection tests do). Kept fresh on purpose: the checks of
  what a fresh interpreter imports, and `python -c`.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM = Path(__file__).with_name("warm_python")
ENV = "FLAT_PPO_FORKSERVER"
LAUNCHER = "accelerate.commands.launch"
# what a short train_ppo.py run imports that takes time, in an order that imports cleanly
WARM = ["numpy", "yaml", "pandas", "torch", "torch.distributed", "torch.distributed.run", "safetensors.torch",
        "tokenizers", "transformers", "transformers.modeling_utils", "transformers.generation.utils",
        "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
        "transformers.models.qwen2.modeling_qwen2", "accelerate", "accelerate.commands.launch", "deepspeed",
        "mlflow", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store", "mlflow.data",
        "mlflow.tracing.processor.base_mlflow", "sqlalchemy.dialects.sqlite", "git", "matplotlib",
        "matplotlib.pyplot", "tqdm", "psutil",
        # DeepSpeed's optimizer check imports its Muon optimizer, which builds a torch.compile wrapper at
        # import: 1.3-2.3 s in every rank of every DeepSpeed run
        "deepspeed.runtime.zero.muon.muon_optimizer"]

VLLM = "vllm"   # the flavour of the second server, and what a command names to be served by it
_servers: dict[str, subprocess.Popen] = {}
_folder = ""


def start() -> None:
    """Start this process's server (it imports in the background; warm_python waits for it).
    The vLLM server's socket is named in the environment now and the server started on demand;
    warm_python uses it only once that server is starting (its socket's ".starting" file)."""
    global _folder
    if _servers or os.environ.get("FLAT_PPO_TESTS_FRESH", "") not in ("", "0") \
            or not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
        return
    _folder = tempfile.mkdtemp(prefix="forkserver_")
    _start("plain")
    os.environ[ENV] = _socket("plain")
    os.environ[ENV + "_VLLM"] = _socket(VLLM)
    os.environ[ENV + "_PYTHON"] = sys.executable


def _socket(flavour: str) -> str:
    return os.path.join(_folder, "socket" if flavour == "plain" else f"socket_{flavour}")


def _start(flavour: str):
    path = _socket(flavour)
    if flavour != "plain":   # warm_python sends a command here only once this server is starting
        open(path + ".starting", "w").close()
    _servers[flavour] = subprocess.Popen([sys.executable, __file__, "--serve", path, flavour], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, cwd=Path(__file__).parent)


def stop() -> None:
    global _folder
    for server in _servers.values():
        server.terminate()
    for server in _servers.values():
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    _servers.clear()
    for name in (ENV, ENV + "_VLLM", ENV + "_PYTHON"):
        os.environ.pop(name, None)
    if _folder:
        shutil.rmtree(_folder, ignore_errors=True)   # the sockets' own folder
        _folder = ""


def command(cmd) -> list[str]:
    """cmd through warm_python (and an accelerate launch's ranks too) when the server runs."""
    cmd = [str(c) for c in cmd]
    if not _servers or len(cmd) < 2 or cmd[0] != sys.executable:
        return cmd
    if VLLM not in _servers and names_vllm(cmd[1:]):
        _start(VLLM)
    if cmd[1:3] == ["-m", LAUNCHER] and "--no_python" not in cmd and "-m" not in cmd[3:]:
        script = next((i for i in range(3, len(cmd)) if cmd[i].endswith(".py")), None)
        if script is not None:
            cmd = [*cmd[:script], "--no_python", str(SHIM), *cmd[script:]]
    if cmd[1] == "-m" or cmd[1].endswith(".py"):
        return [cmd[0], str(SHIM), *cmd[1:]]
    return cmd


def names_vllm(argv) -> bool:
    """An argument whose last path part names vLLM (`--rollout_engine=vllm`, scripts/vllm_*.py), not
    a folder on the way (a test's tmp_path)."""
    return any(VLLM in os.path.basename(a).lower() for a in argv)


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command(cmd), **kwargs)


def Popen(cmd, **kwargs) -> subprocess.Popen:  # noqa: N802 (subprocess's name)
    return subprocess.Popen(command(cmd), **kwargs)


# ---- the server: `python tests/forkserver.py --serve SOCKET plain|vllm` ----

def _serve(path: str, flavour: str):
    import gc
    import importlib
    if flavour == VLLM:
        # what train_ppo.py's setup does before anything else (plumbing/lean_imports.py): no Triton
        # without CUDA. The repository's module is dropped again: each child imports its own.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from plumbing import lean_imports
        lean_imports.skip_unused()
        del sys.path[0]
        for name in [m for m in sys.modules if m == "plumbing" or m.startswith("plumbing.")]:
            del sys.modules[name]
    for name in WARM + (["vllm", "vllm.entrypoints.llm", "vllm.platforms"] if flavour == VLLM else []):
        try:
            importlib.import_module(name)
        except Exception:   # a library this environment lacks: the child imports (or refuses) it itself
            pass
    _draw_once()
    # the libraries' objects into the collector's permanent generation (gc.freeze, the documented
    # fork-server pattern; vLLM does the same when it starts an engine): a child's full collections
    # (Accelerate's free_memory at a run's end, 1.3 s) then skip the server's ~1M objects
    gc.freeze()
    base_path = sys.path[1:]   # the site folders, without this file's folder
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)   # warm_python connects once the imports are done
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:   # the pytest process that started it is gone: so is the server
        if select.select([listener], [], [], 0.05)[0]:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                _child(request, fds, conn, base_path)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            _reply(conn, pid)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                _reply(conn, os.waitstatus_to_exitcode(status))
                conn.close()


def _draw_once():
    """A run draws curves.png with matplotlib (Agg): its first drawing in a process also loads the
    font cache and builds the text machinery, about 0.4 s a run; done here once."""
    try:
        import io
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots()
        ax.plot([0, 1], [0, 1])
        ax.set_title("warm")
        fig.savefig(io.BytesIO(), format="png")
        plt.close(fig)
    except Exception:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size, data = int.from_bytes(header, "big"), b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("warm_python closed its connection mid-request")
        data += chunk
    if len(fds) != 3:
        raise ValueError("warm_python sends its three stdio descriptors")
    return json.loads(data), fds


def _reply(conn: socket.socket, value: int):
    try:
        conn.sendall(f"{value}\n".encode())
    except OSError:   # warm_python was killed: its child has killed itself too
        pass


def _child(request: dict, fds: list[int], conn: socket.socket, base_path: list[str]):
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        _watch_caller(conn)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _threads_as_at_import()
        argv = list(request["argv"])
        unbuffered = os.environ.get("PYTHONUNBUFFERED", "") not in ("", "0")
        if argv and argv[0] == "-u":
            argv, unbuffered = argv[1:], True
        sys.stdin = open(0, closefd=False)
        sys.stdout = _text_stream(1, line_buffering=unbuffered, write_through=unbuffered)
        sys.stderr = _text_stream(2, line_buffering=True, errors="backslashreplace")
        python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        module = argv[1] if argv[:1] == ["-m"] else None
        first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
        sys.path[:] = [first, *python_path, *base_path]
        sys.argv = argv[1:] if module else argv
        _site_customize(python_path)
        code = _run(module, None if module else os.path.abspath(argv[0]))
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def _threads_as_at_import():
    """torch sizes its thread pool from $OMP_NUM_THREADS when it is imported; the server imported
    it before this command's environment (torch's elastic agent gives each rank OMP_NUM_THREADS=1)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _watch_caller(conn: socket.socket):
    """warm_python holds the other end of conn until the command ends; if it is killed (a test's
    timeout, a launcher stopping its ranks with SIGKILL), this process follows it."""
    import threading

    def watch():
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="forkserver-caller", daemon=True).start()


def _site_customize(python_path: list[str]):
    """A fresh interpreter imports the first sitecustomize.py on its path at start (tests put one
    in a $PYTHONPATH folder to inject faults); the server imported none."""
    for folder in python_path:
        if os.path.isfile(os.path.join(folder, "sitecustomize.py")):
            import importlib
            importlib.import_module("sitecustomize")
            return


def _text_stream(fd: int, **kwargs):
    import io
    return io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)), encoding="utf-8", **kwargs)


def _run(module: str | None, script: str | None) -> int:
    import atexit
    import runpy
    import threading
    import traceback
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:   # an interpreter ends by the signal, after its traceback and clean-up
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    # what the interpreter does at exit: join non-daemon threads, run atexit handlers, flush
    try:
        threading._shutdown()
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--serve":
    _serve(sys.argv[2], sys.argv[3])
