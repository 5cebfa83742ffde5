"""Shared test helpers: the repository root, the snippet runner, the built site,
and a Redis server of the test's own."""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Before anything imports torch, whose OpenMP runtime reads it once: idle threads
# sleep rather than spin. Two test processes on two cores each run torch on two
# threads, and spinning threads stall each other's process; no result changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from tests.redis_server import redis_server  # noqa: F401, E402  (a fixture for every test)

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


def load_runner():
    """snippets/_runner.py is a script, not a package; load it by path."""
    return load_script(ROOT / "snippets" / "_runner.py", "snippet_runner")


def load_script(path: Path, name: str):
    """Import a file that is not in a package; registered, so dataclasses in it work."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


@dataclass(frozen=True)
class Site:
    url: str  # where it is served, ending in /
    path: Path  # the built files


def environ_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Iterator[Site]:
    """The book, built once with `mkdocs build --strict` and served on 127.0.0.1."""
    out = tmp_path_factory.mktemp("site")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=out))
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    # Instant navigation only follows links whose origin matches the sitemap's,
    # so the site is built for the port it is served on.
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        check=True,
        env={**environ_without("BOOK_PDF"), "NO_MKDOCS_2_WARNING": "1", "SITE_URL": url},
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Site(url, out)
    server.shutdown()


CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))


@pytest.fixture(scope="session")
def print_site(tmp_path_factory) -> Path:
    """The book as `make pdf` builds it (BOOK_PDF: the print page, and every page
    linking the PDF and the EPUB), built once for the PDF's and the EPUB's tests,
    which each print it, as `make pdf` prints one build to both, and add only their
    own file to it. Under pytest-xdist the workers share one build: the first to
    need it builds it, under a lock the others wait on."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs /usr/bin/chromium as root")
    if "book_pdf" not in sys.modules:  # docs/tools/epub.py loads pdf.py under this name too
        load_script(ROOT / "docs" / "tools" / "pdf.py", "book_pdf")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp("print-site")
        sys.modules["book_pdf"].build(out)
        return out
    run = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
    out, done = run / "print-site", run / "print-site.built"
    with (run / "print-site.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a build that failed half way
            sys.modules["book_pdf"].build(out)
            done.touch()
    return out


def gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" in status.read_text()


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if not gone(p)]
