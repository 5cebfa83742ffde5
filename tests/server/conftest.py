"""Servers on loopback for the server's tests: `deepinfer serve` and `deepinfer
router` as the subprocesses a user would start, each on a free port, each
stopped when its test (or session) ends, whether it passed or not."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.tools.launch import tree_memory
from tests.conftest import ROOT

TINY = ROOT / "snippets" / "models" / "deepinfer-tiny"
API_KEY = "test-key-0123456789"
# The session server: a cache small enough to keep RSS low, and a context short
# enough that the longest request a fuzzer can make is a fraction of a second.
SERVE_ARGS = [
    "--num-kv-blocks",
    "1024",
    "--max-model-len",
    "128",
    "--seed",
    "0",
    "--dtype",
    "float32",
]
START_TIMEOUT_S = 120
# No server test may hang CI: past this, pytest-timeout fails it (setup, call and
# teardown together), and its fixtures still stop the servers they started.
TEST_TIMEOUT_S = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """Resident memory of the server, its engine core's process included
        (VmHWM: the sum of each process's peak)."""
        return tree_memory(self.proc.pid, field)

    def kill(self) -> None:
        """Abruptly, as a crash would: no graceful shutdown."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",  # the tests share two cores with the servers
    }


def spawn(command: str, *args: str, environ: dict[str, str] | None = None) -> Running:
    """Start `deepinfer COMMAND ARGS --port P`, in ``environ`` (default: env());
    see ready() and stop()."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"deepinfer-{command}-", suffix=".log")[1])
    argv = [sys.executable, "-m", "engine.tools.cli", command, *args, "--port", str(port)]
    with log.open("w") as sink:
        proc = subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, env=environ or env(), cwd=ROOT
        )
    return Running(f"http://127.0.0.1:{port}", proc, log)


def ready(server: Running) -> Running:
    """Wait until it answers /health with 200."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"exited with {server.proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        if time.monotonic() > deadline:
            raise RuntimeError(f"did not start:\n{server.log_tail()}")
        time.sleep(0.2)


def stop(server: Running) -> None:
    proc = server.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
    server.log.unlink(missing_ok=True)


@contextlib.contextmanager
def running(*commands: tuple[str, ...]) -> Iterator[list[Running]]:
    """Several servers, started together and all stopped at the end, whatever happens."""
    servers: list[Running] = []
    try:
        for command in commands:
            servers.append(spawn(*command))
        yield [ready(s) for s in servers]
    finally:
        for s in servers:
            stop(s)


@pytest.fixture(scope="session")
def server() -> Iterator[Running]:
    """One `deepinfer serve` on deepinfer-tiny with an API key, shared by the tests
    that do not need a server of their own."""
    with running(("serve", str(TINY), *SERVE_ARGS, "--api-key", API_KEY)) as (s,):
        yield s


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def completion_choices(
    url: str, body: dict, stream: bool = False, headers: dict | None = None
) -> list[tuple[int, str, str]]:
    """(index, text, finish reason) of each choice of a /v1/completions request,
    streamed (the deltas joined) or not, sorted by index."""
    body = {"model": "deepinfer-tiny", **body, "stream": stream}
    if not stream:
        reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        return sorted((c["index"], c["text"], c["finish_reason"]) for c in reply.json()["choices"])
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line.removeprefix("data: "))["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                    reasons[c["index"]] = c.get("finish_reason") or reasons.get(c["index"])
    return sorted((i, texts[i], reasons[i]) for i in texts)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """The sum of a Prometheus series over its labels, read from /metrics."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    family = name.removesuffix("_total")
    declared = f"# TYPE {name} " in text or f"# TYPE {family} counter" in text
    assert seen or declared, f"{name} is not in {url}/metrics"
    return total  # a labelled family with no series yet counts 0


@contextlib.contextmanager
def in_thread(app) -> Iterator[str]:
    """An app under uvicorn in this process, for tests that reach inside it."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(autouse=True)
def sigint_handler_restored() -> Iterator[None]:
    """run_core ignores Ctrl-C, as its own process should, and some tests run it in
    this one: the handler comes back after each test. Otherwise every process a
    later test starts inherits Ctrl-C ignored (test_expert_parallel's Ctrl-C test
    then waited on an engine that never saw it)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)
