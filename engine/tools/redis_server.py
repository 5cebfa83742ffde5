"""A redis-server of one's own, on a free loopback port, that persists nothing
and evicts by LRU: what the store's tests, the service's tests and
`python -m engine.tools.store_bench` run against, so that none of them touches
a server someone else runs. It can be stopped and started again on the same
port, as a test of a store that outlives its server needs."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

from engine.tools.launch import free_port

MISSING = "redis-server is not installed: `make test` installs Debian's redis-server (as root)"


class RedisServer:
    """``redis-server`` on 127.0.0.1, bounded by ``maxmemory`` (Redis's own
    syntax: "64mb"). A context manager: started on entry, stopped on exit."""

    def __init__(self, maxmemory: str = "64mb", port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError(MISSING)
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.process: subprocess.Popen[bytes] | None = None
        # Its log: a pipe could fill up and stall it. Open as long as the server.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20) -> None:
        """Start it (again, on the same port) and return once it answers PING."""
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", tempfile.gettempdir()]
        argv += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self.process.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"redis-server exited:\n{self._log.read().decode()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer in {timeout_s} s")
            time.sleep(0.05)

    def answers(self) -> bool:
        """Whether a server on this port answers PING (in the wire protocol)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop it, if it runs; what it held is gone (it persists nothing)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._log.close()
