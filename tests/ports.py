"""A free TCP port for a test's `accelerate launch --main_process_port` (or a server): tests run on
several pytest-xdist workers at once, so a port derived from the process id could collide."""
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
