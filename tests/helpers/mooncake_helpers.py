"""Mooncake Store for the L3 tests: the shared master of ``.ci/mooncake-up``, private masters
and segment owners that a test may kill.

* ``HPC_MOONCAKE_URL`` (``mooncake://127.0.0.1:PORT``) and ``HPC_MOONCAKE_METADATA`` (the
  master's HTTP metadata server) come from ``.ci/mooncake-up``; without them, or without the
  Mooncake client (``pip install .[mooncake]``), the Mooncake tests skip saying why, except
  under CI (``CI`` set), where a missing master is a failure.
* :class:`MooncakeMaster` runs a private ``mooncake_master`` (HTTP metadata server built in) on
  free loopback ports; :class:`SegmentOwner` is another process whose client lends the store
  a segment of its memory, so a test can kill the process that holds the pages.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.server_helpers import ChildProcess, free_ports, wait_port

# The client logs through glog, read from the environment when it is first imported: warnings
# and errors only, so a failing test's output stays readable.
os.environ.setdefault("GLOG_minloglevel", "1")

MOONCAKE_ENV = "HPC_MOONCAKE_URL"
MOONCAKE_META_ENV = "HPC_MOONCAKE_METADATA"


def _skip_or_fail(msg: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide Mooncake Store: {msg}")
    pytest.skip(msg)


def mooncake_package() -> Path:
    """The installed ``mooncake`` package's directory (its binaries live there)."""
    try:
        importlib.import_module("mooncake.store")  # the client itself must load (libibverbs1)
    except ImportError as exc:
        _skip_or_fail(f"the Mooncake client is not importable ({exc}); pip install '.[mooncake]' "
                      "and apt-get install libibverbs1 (.ci/mooncake-up does)")
    import mooncake

    return Path(mooncake.__file__).parent


def need_mooncake() -> tuple[str, str]:
    """(``mooncake://`` URL, metadata server) of the shared master, or skip saying why."""
    mooncake_package()
    url, meta = os.environ.get(MOONCAKE_ENV), os.environ.get(MOONCAKE_META_ENV)
    if not url or not meta:
        _skip_or_fail(f'{MOONCAKE_ENV} / {MOONCAKE_META_ENV} are not set: start a master first '
                      'with eval "$(bash .ci/mooncake-up)"')
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    assert url is not None and meta is not None
    return url, meta


def mooncake_extra(meta: str, segment: int = 0, zero_copy: bool = True, **more: Any) -> dict[str, Any]:
    """Extra config of a test client: lends ``segment`` bytes (0: the standalone client of
    ``.ci/mooncake-up`` or a :class:`SegmentOwner` holds the pages); with ``zero_copy``, every
    batch takes the zero-copy path, however small."""
    return {"metadata_server": meta, "global_segment_size": segment, "protocol": "tcp",
            "local_hostname": "127.0.0.1", "zero_copy": zero_copy, "zero_copy_min_bytes": 0,
            **more}


class MooncakeMaster(ChildProcess):
    """A private ``mooncake_master`` with its HTTP metadata server, on fixed free ports (so a
    restart comes back where its clients look)."""

    def __init__(self, tmp: str, *args: str) -> None:
        self.exe = str(mooncake_package() / "mooncake_master")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self.rpc = self.http = self.metrics = 0
        self.args, self.log = args, Path(tmp) / "master.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.launch(self._pick_ports, self.start)

    def _pick_ports(self) -> None:
        self.rpc, self.http, self.metrics = free_ports(3)

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
                 "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics}", "--rpc_thread_num=2", *self.args],
                stdout=log, stderr=log)
        wait_port(self.rpc, what="mooncake_master: no RPC port", proc=self.proc)
        wait_port(self.http, what="mooncake_master: no metadata server", proc=self.proc)

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"


_OWNER = """
import os, sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
print(rc, flush=True)
time.sleep(3600)
"""


class SegmentOwner(ChildProcess):
    """Another process whose Mooncake client lends ``segment`` bytes to ``master``."""

    def __init__(self, master: MooncakeMaster, segment: int) -> None:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.proc: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, "-c", _OWNER, master.metadata, str(segment), master.url[len("mooncake://"):]],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "0":
            self.kill()
            raise RuntimeError(f"segment owner setup returned {line!r}")
