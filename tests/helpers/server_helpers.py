"""Private server processes the L3 tests start and kill (redis-server, mooncake_master, a
Mooncake segment owner): the loopback port wait and the hard kill they share."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from typing import Any


def wait_port(port: int, timeout_s: float = 10.0, poll_s: float = 0.05,
              what: str | None = None) -> None:
    """Return once something accepts TCP connections on loopback ``port``; after
    ``timeout_s`` seconds raise ``RuntimeError(what)`` (default: which port stayed silent)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(poll_s)
    raise RuntimeError(what or f"nothing listens on port {port}")


class ChildProcess:
    """A server the test owns: ``proc`` while it runs, ``kill()`` to stop it at once (SIGKILL:
    the tests of crashes want no graceful shutdown), a no-op once stopped."""

    proc: subprocess.Popen[Any] | None = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
            self.proc = None
