"""`deepinfer bench --serve` prints, for each number of clients, the server's and
LLM.generate's figures on one workload and their ratio, and they agree; and it
splits the server's TTFT at its engine's door."""

from __future__ import annotations

import re

from tests.engine.test_cli import deepinfer
from tests.server.conftest import TINY


def test_bench_serve_prints_both_sides_and_their_ratio() -> None:
    proc = deepinfer(
        "bench", "--serve", "--model", str(TINY), "--num-prompts", "4", "--input-len", "8:16",
        "--output-len", "4", "--concurrency", "1,2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    tables = re.findall(
        r"(\d+) concurrent clients\n.*\n(server.*)\n(offline.*)\n(ratio.*)\n"
        r"server TTFT from arrival in its engine: (\S+) ms mean; HTTP and the clients: (\S+) ms",
        proc.stdout,
    )
    assert [t[0] for t in tables] == ["1", "2"], proc.stdout
    for _, server, offline, ratio, inside, outside in tables:
        # The engine's interval lies within the client's, on one monotonic clock.
        assert float(inside) > 0 and float(outside) >= -0.1, proc.stdout
        s = [float(v) for v in server.split()[1:]]
        o = [float(v) for v in offline.split()[1:]]
        r = [float(v.rstrip("x")) for v in ratio.split()[1:]]
        assert all(v > 0 for v in s + o), proc.stdout
        for a, b, q in zip(s, o, r):  # printed to 0.1 and 0.01
            assert abs(q - a / b) <= 0.01 + 0.1 * (1 / b + a / b**2), proc.stdout
