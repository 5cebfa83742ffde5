"""Start a `deepinfer` server as a subprocess on a free loopback port, wait until
it answers /health, and stop it at the end, whatever happens: what the serving
demos and `deepinfer bench --serve` need."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 300
) -> Iterator[str]:
    """`deepinfer ARGS --port P`, quiet; yields its URL."""
    with launched_process(*args, env=env, timeout_s=timeout_s) as (url, _):
        yield url


@contextlib.contextmanager
def launched_process(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 300
) -> Iterator[tuple[str, subprocess.Popen]]:
    """As launched, and the process too, for a caller that stops or kills it."""
    port = free_port()
    argv = [sys.executable, "-m", "engine.tools.cli", *args, "--port", str(port)]
    argv += ["--log-level", "warning"]
    with tempfile.TemporaryFile() as log:  # a pipe could fill up and stall the server
        proc = subprocess.Popen(
            argv, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=log
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while not _healthy(url):
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"deepinfer {args[0]} exited:\n{log.read().decode()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"deepinfer {args[0]} did not start in {timeout_s} s")
                time.sleep(0.2)
            yield url, proc
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot terminate
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def descendants(pid: int) -> list[int]:
    """The process's children, theirs, and so on (Linux's /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:  # it ended meanwhile
                continue
            found += kids
            todo += kids
    return found


def tree_memory(pid: int, field: str = "VmRSS") -> int:
    """Resident memory (VmRSS) or its peak (VmHWM) of a process and all of its
    descendants, summed, in bytes: a server is its front end and its engine
    core's process (entrypoints/core_process.py)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:  # it ended meanwhile
            continue
        total += sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))
    return total


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False
