"""The python tool's sandbox (rollout/tools/sandbox.py), attacked the way the review did: code the
policy could write, run through the tool set a training run builds (or run_python with the project's
limits), against the real bwrap. Each test names what must hold afterwards, on the host."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from config import Config, load_config
from errors import UserError
from rollout.tools import PythonLimits, ToolCall, ToolSet, run_python
from rollout.tools.rollouts import _tool_functions, make_tool_rollouts
from test_tools import qwen_style_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "rollout.tools.builtin:python"

# libc through ctypes: what the review used to get past the audit hook (no Python-level event)
LIBC = r'''
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
def connect(family, address):
    fd = libc.socket(family, 1, 0)
    ok = fd >= 0 and libc.connect(fd, address, len(address)) == 0
    if ok:
        libc.send(fd, b"hello", 5, 0)
    return ok
def tcp(port):
    return connect(2, struct.pack("<H", 2) + struct.pack(">H", port) + bytes([127, 0, 0, 1]) + bytes(8))
def unix(path):   # a leading NUL: the abstract namespace
    return connect(1, struct.pack("<H", 1) + path + bytes(108 - len(path)))
def spawn(*argv):   # fork, setsid, fork again, exec: a daemon nobody waits for
    if libc.fork() == 0:
        libc.setsid()
        if libc.fork() == 0:
            args = (ctypes.c_char_p * (len(argv) + 1))(*[a.encode() for a in argv], None)
            libc.execv(argv[0].encode(), args)
        os._exit(0)
'''


@pytest.fixture(scope="module")
def tools() -> ToolSet:
    """The tool set a run with tools: rollout.tools.builtin:python builds (default limits and sandbox)."""
    cfg = Config(tools=PYTHON)
    return ToolSet(_tool_functions(cfg), timeout_s=cfg.tool_timeout_s)


def call(tools: ToolSet, code: str):
    return tools.run(ToolCall("python", {"code": code}))


def processes_with(token: str) -> list[int]:
    """The host's processes whose command line holds `token`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if token.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


# --- network -------------------------------------------------------------------------------------

def test_no_network_no_sockets_of_the_host(tools, tmp_path):
    """A TCP listener on 127.0.0.1, an abstract Unix socket and one on disk, all opened here: the
    tool's code reaches none of them (no connection arrives, nothing is sent)."""
    tcp = socket.create_server(("127.0.0.1", 0))
    name = f"flat_ppo_test_{uuid.uuid4().hex}".encode()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0" + name)
    on_disk = socket.socket(socket.AF_UNIX)
    on_disk.bind(str(tmp_path / "s.sock"))
    for s in (tcp, abstract, on_disk):
        s.listen(4)
        s.setblocking(False)
    try:
        result = call(tools, LIBC + f"print(tcp({tcp.getsockname()[1]}), unix(b'\\0' + {name!r}), "
                                    f"unix({str(tmp_path / 's.sock').encode()!r}))")
        assert result.ok and result.text.split() == ["False", "False", "False"], result.text
        for s in (tcp, abstract, on_disk):
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in (tcp, abstract, on_disk):
            s.close()


# --- files outside the tmpfs ---------------------------------------------------------------------

ATTACK_FILES = r'''
import os, sys
for path in sys.argv[1:]:
    for what, act in (("read", lambda: print(open(path).read())), ("write", lambda: open(path, "w").write("x")),
                      ("append", lambda: open(path, "a").write("x")), ("delete", lambda: os.remove(path)),
                      ("create", lambda: open(path + ".new", "w").write("x"))):
        try:
            act()
            print("DONE", what, path)
        except OSError as e:
            print("refused", what, type(e).__name__)
'''


def test_files_of_the_host_are_out_of_reach(tools, tmp_path, monkeypatch):
    """Sentinel files in the checkout, a run directory, $HOME (with a .netrc) and the host's /tmp:
    after the tool read, wrote, appended to, deleted and created beside each, every one holds what
    it held and no secret came back."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    secret = f"machine example.com login me password {uuid.uuid4().hex}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tmp_file = Path("/tmp") / f"flat_ppo_sentinel_{uuid.uuid4().hex}"
    sentinels = {ROOT / f".sentinel_{uuid.uuid4().hex}": f"checkout {uuid.uuid4().hex}",
                 run_dir / "metrics.jsonl": f"run {uuid.uuid4().hex}", home / ".netrc": secret,
                 tmp_file: f"tmp {uuid.uuid4().hex}"}
    try:
        for path, text in sentinels.items():
            path.write_text(text)
        code = ATTACK_FILES.replace("sys.argv[1:]", repr([str(p) for p in sentinels]))
        result = call(tools, code)
        # (inside, /tmp is the tool's own tmpfs: a write there may succeed, and lands in the tmpfs)
        assert not any(text in result.text for text in sentinels.values()), result.text
        for path, text in sentinels.items():
            assert path.read_text() == text and not Path(f"{path}.new").exists(), path
    finally:
        for path in sentinels:
            path.unlink(missing_ok=True)
            Path(f"{path}.new").unlink(missing_ok=True)


# --- secrets -------------------------------------------------------------------------------------

def test_no_secret_of_the_trainer_reaches_the_code(tools, monkeypatch):
    """A secret in this process's environment: not in the tool's os.environ, nor in any /proc/*/environ
    it can read (its parent's, its PID 1's, this process's by its host PID)."""
    secret = f"flat-ppo-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("FLAT_PPO_TEST_SECRET", secret)
    code = f'''
import os
print(dict(os.environ))
for pid in {{os.getppid(), 1, {os.getpid()}}} | {{int(p) for p in os.listdir("/proc") if p.isdigit()}}:
    try:
        print(pid, open(f"/proc/{{pid}}/environ").read())
    except OSError as e:
        print(pid, type(e).__name__)
'''
    result = call(tools, code)
    assert result.ok and "PATH" in result.text, result.text   # what it read came back
    assert secret not in result.text


# --- signals -------------------------------------------------------------------------------------

VICTIM = r'''
import os, sys
from rollout.tools import ToolCall, ToolSet
tools = ToolSet.from_specs(["rollout.tools.builtin:python"])
for code in sys.argv[1:]:
    result = tools.run(ToolCall("python", {"code": code.replace("VICTIM", str(os.getpid()))}))
    print("alive after", repr(result.text[:80]), flush=True)
'''
KILLS = ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
         "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
         "import os, signal\nos.kill(VICTIM, signal.SIGKILL)"]


@pytest.mark.parametrize("minus_one", [False, True], ids=["parent_group_pid", "minus_one"])
def test_signals_do_not_reach_the_trainer(minus_one):
    """A process running the tool set (in its own session, so nothing else is at stake) survives tool
    code that SIGKILLs its parent, its parent's group and the trainer by its host PID; and, in a test
    of its own (on the old executor it killed every process of the user), every process it may signal."""
    kills = ["import os, signal, time\nos.kill(-1, signal.SIGKILL)\ntime.sleep(1)"] if minus_one else KILLS
    proc = subprocess.Popen([sys.executable, "-c", VICTIM, *kills], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.count("alive after") == len(kills), out


# --- processes outliving the call ----------------------------------------------------------------

@pytest.mark.parametrize("timed_out", [False, True], ids=["returned", "timed_out"])
def test_no_process_outlives_the_call(timed_out):
    """A daemon (fork, setsid, fork, exec sleep) and a child left in the tool's group: none is alive
    once the call has returned, whether the code returned or was killed at the timeout."""
    token = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"   # sleep's argument, unique
    code = LIBC + f'''
import _posixsubprocess
spawn("/bin/sleep", "{token}")
try:   # in the tool's session and group, holding its stdout
    _posixsubprocess.fork_exec([b"/bin/sleep", b"{token}"], [b"/bin/sleep"], False, (), None, None, -1, -1, -1,
                               -1, -1, -1, -1, -1, False, False, -1, None, None, None, -1, None, False)
except OSError:   # where the sandbox starts no processes at all (as root: see sandbox.py)
    pass
import time
time.sleep({60 if timed_out else 0.5})
'''
    try:
        run_python(code, PythonLimits(timeout_s=3))
    except Exception:
        pass
    left = processes_with(token)
    for pid in left:   # ours (the token is unique): not left behind when this fails
        os.kill(pid, signal.SIGKILL)
    assert left == []


# --- escapes past a Python-level hook ------------------------------------------------------------

def test_processes_started_behind_pythons_back_are_contained(tools, tmp_path):
    """libc fork/execv through ctypes and _posixsubprocess.fork_exec (no audit event): what they
    start, a shell writing a file on the host, writes nothing here."""
    targets = [tmp_path / "by_ctypes", tmp_path / "by_fork_exec"]
    code = LIBC + f'''
import _posixsubprocess, time
spawn("/bin/sh", "-c", "echo pwned > {targets[0]}")
try:
    pid = _posixsubprocess.fork_exec([b"/bin/sh", b"-c", b"echo pwned > {targets[1]}"], [b"/bin/sh"], True, (),
                                     None, None, -1, -1, -1, -1, -1, -1, -1, -1, False, False, -1, None, None, None,
                                     -1, None, False)
    os.waitpid(pid, 0)
except OSError as e:
    print("refused", e)
time.sleep(1)
'''
    call(tools, code)
    assert [t for t in targets if t.exists()] == []


# --- resource exhaustion -------------------------------------------------------------------------

@pytest.mark.parametrize("code, expected", [
    ("x = bytearray(8 * 2**30)", "MemoryError"),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        os._exit(3)", "exit status 3"),
    ("for i in range(20_000):\n    open(f'f{i}', 'wb').write(bytes(16_000))", "No space left"),   # 320 MB
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 2**20)", "output exceeded"),
], ids=["memory", "fork_bomb", "disk", "output"])
def test_exhaustion_is_an_error_and_the_trainer_lives(tools, code, expected):
    """Memory, processes, the tmpfs and the output pipe, each run past its limit: an error
    observation (at most max_observation_chars long) and this process goes on."""
    result = call(tools, code)
    assert not result.ok and expected in result.text, result.text[:500]
    assert len(result.text) <= tools.max_observation_chars + 100


def test_errors_are_capped_and_name_the_signal(tools):
    """An error observation is cut like a result; a call killed by a signal names it."""
    result = call(tools, "raise ValueError('x' * 20_000)")
    assert not result.ok and "ValueError" in result.text
    assert len(result.text) <= tools.max_observation_chars + 100
    result = call(tools, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.text == "error: python: killed by signal SIGKILL"


# --- the output channel --------------------------------------------------------------------------

def test_the_code_cannot_block_the_reader(tmp_path):
    """The code replaces whatever it can reach where the output might be read from (every file of
    its working directory and its parent) with FIFOs: the call still returns."""
    code = '''
import os
for d in (".", ".."):
    for name in list(os.listdir(d)) + ["stdout", "stderr"]:
        path = os.path.join(d, name)
        try:
            if os.path.isfile(path) or not os.path.exists(path):
                if os.path.exists(path):
                    os.remove(path)
                os.mkfifo(path)
        except OSError:
            pass
print("done")
'''
    box = []
    worker = threading.Thread(target=lambda: box.append(_safe(code)), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and box, "the call did not return"


def _safe(code):
    try:
        return run_python(code)
    except Exception as e:
        return str(e)


# --- startup -------------------------------------------------------------------------------------

NO_USERNS = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"'
BUILD = '''
from config import Config
from errors import UserError
from rollout.tools.rollouts import _tool_functions
for mode in ("bwrap", "none"):
    try:
        (fn,) = _tool_functions(Config(tools="rollout.tools.builtin:python", tool_sandbox=mode))
        print("started:", fn(code="print(6 * 7)").strip())
    except UserError as e:
        print("UserError:", e)
'''


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_without_user_namespaces_the_run_stops_unless_tool_sandbox_none():
    """Where no user namespace can be created (here: inside a user namespace whose own limit on user
    namespaces is 0, so the kernel refuses bwrap's), building the python tool as a run does is one
    UserError naming tool_sandbox and the setting to change; with tool_sandbox: none the tool runs."""
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", NO_USERNS, sys.executable, BUILD],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode and "max_user_namespaces" in proc.stderr:
        pytest.skip(f"cannot set up the test: {proc.stderr.strip()[-200:]}")
    refused, started = proc.stdout.strip().splitlines()
    assert refused.startswith("UserError: tool_sandbox=bwrap: ") and "max_user_namespaces" in refused, refused
    assert "tool_sandbox: none" in refused
    assert started == "started: 42", proc.stdout + proc.stderr


def test_tool_sandbox_takes_bwrap_or_none():
    with pytest.raises(UserError, match="tool_sandbox must be 'bwrap' or 'none', got 'docker'"):
        load_config([f"--tools={PYTHON}", "--tool_sandbox=docker"])


@pytest.mark.parametrize("tools_spec, sandbox, notes", [
    (PYTHON, "bwrap", ({"tool_sandbox": "bwrap"}, [])),
    (PYTHON, "none", ({"tool_sandbox": "none"}, ["tool_sandbox=none: the python tool runs"])),
    ("rollout.tools.builtin:calculator", "none", ({}, [])),
])
def test_the_run_tags_the_sandbox_and_warns_without_one(tools_spec, sandbox, notes):
    """What train_ppo.py adds to the MLflow tags and prints as a warning at startup: the sandbox when
    the python tool is configured, a warning when it is none, nothing for other tools."""
    rollouts = make_tool_rollouts(Config(tools=tools_spec, tool_sandbox=sandbox), qwen_style_tokenizer())
    tags, warnings = rollouts.sandbox_notes()
    assert tags == notes[0] and len(warnings) == len(notes[1])
    assert all(w.startswith(start) for w, start in zip(warnings, notes[1]))

