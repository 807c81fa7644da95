"""Private server processes the L3 tests start and kill (redis-server, mooncake_master, a
Mooncake segment owner): the ports they listen on, the loopback port wait and the hard kill
they share.

Ports come from :data:`PORT_RANGE`, below the kernel's ephemeral range (32768-60999 on Linux),
where every outgoing connection on the machine takes its local port: a port found free there
can be taken again before the server binds it. A server that still fails to bind (another test
run picked the same port meanwhile) exits; :meth:`ChildProcess.launch` then starts it again on
fresh ports.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

#: The ports test servers listen on: [low, high), below the ephemeral range.
PORT_RANGE = (20000, 32000)
#: How long a server may take to listen on a loaded machine [s]; costs nothing when fast.
START_WAIT_S = 30.0
#: Fresh ports tried before a server that exits at start is an error.
START_TRIES = 5


class ServerExited(RuntimeError):
    """The server process exited before it listened (e.g. its port was taken)."""


def bindable(port: int) -> bool:
    """Whether loopback ``port`` can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(n: int, bus_offset: int = 0) -> list[int]:
    """``n`` distinct loopback ports in :data:`PORT_RANGE` free now; with ``bus_offset``, each
    port's ``port + bus_offset`` (a Redis Cluster bus port) is free and in the range too."""
    rng = random.Random()
    low, high = PORT_RANGE
    out: list[int] = []
    while len(out) < n:
        port = rng.randrange(low, high - bus_offset)
        taken = set(out) | {p + bus_offset for p in out}
        if port in taken or (bus_offset and port + bus_offset in taken):
            continue
        if bindable(port) and (not bus_offset or bindable(port + bus_offset)):
            out.append(port)
    return out


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (any local address,
    IPv4 or IPv6; Linux's ``/proc``, elsewhere ``True``: whoever answers is taken for it)."""
    if not os.path.exists("/proc/net/tcp"):
        return True
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        inodes |= {f"socket:[{r[9]}]" for r in rows
                   if r[1].endswith(f":{port:04X}") and r[3] == "0A"}  # LISTEN
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


def wait_port(port: int, timeout_s: float = START_WAIT_S, poll_s: float = 0.05,
              what: str | None = None, proc: subprocess.Popen[Any] | None = None) -> None:
    """Return once something accepts TCP connections on loopback ``port`` (with ``proc``: once
    ``proc`` itself listens there, not another process that holds the port). Raises
    ``ServerExited`` as soon as ``proc`` has exited, and ``RuntimeError(what)`` (default: which
    port stayed silent) after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerExited(f"{what or 'the server'}: exited ({proc.returncode}) before it "
                               f"listened on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                if proc is None or listens(proc.pid, port):
                    return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise RuntimeError(what or f"nothing listens on port {port}")
        time.sleep(poll_s)


def freeze(proc: subprocess.Popen[Any]) -> None:
    """Stop ``proc`` with SIGSTOP (its connections stay open, nothing answers) and return once
    every one of its threads is stopped: the signal is delivered asynchronously, and a server
    thread still running could answer a request sent just after ``kill`` returned."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + START_WAIT_S
    while True:
        try:
            tasks = os.listdir(f"/proc/{proc.pid}/task")
        except OSError:
            return  # no /proc (or the process is gone): nothing more to wait for
        states = []
        for t in tasks:
            try:
                with open(f"/proc/{proc.pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if all(st in ("T", "t", "Z", "X") for st in states):
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"process {proc.pid} did not stop: thread states {states}")
        time.sleep(0.005)


class ChildProcess:
    """A server the test owns: ``proc`` while it runs, ``kill()`` to stop it at once (SIGKILL:
    the tests of crashes want no graceful shutdown), a no-op once stopped."""

    proc: subprocess.Popen[Any] | None = None

    def launch(self, pick_ports: Callable[[], None], start: Callable[[], None]) -> None:
        """The first start: ``pick_ports()`` then ``start()`` (which raises ``ServerExited``
        when the server exits before it listens), on fresh ports up to :data:`START_TRIES`
        times. A restart (``start()`` alone) keeps the ports, where the clients look."""
        for attempt in range(START_TRIES):
            pick_ports()
            try:
                start()
                return
            except ServerExited:
                self.kill()
                if attempt == START_TRIES - 1:
                    raise

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(START_WAIT_S)
            self.proc = None
