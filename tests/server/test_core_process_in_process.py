"""The core process's two ends, in this process: ``run_core`` runs on the main
thread (it sets a signal handler) while a thread plays the front end over a
real pipe, and CoreProcess's receiver reads a pipe whose far end the test
holds. Each message and each failure is pinned exactly; test_core_process.py
runs the real child process, which mutation testing cannot see."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import threading
from pathlib import Path

from engine.config import EngineConfig
from engine.entrypoints.core_process import STOP, CoreProcess, QueuedRequest, StartFailed, run_core
from engine.entrypoints.engine_core import CoreBatch, CoreFacts, CoreStats
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from tests.server.conftest import TINY

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def config(model: Path = TINY) -> EngineConfig:
    return EngineConfig(str(model), dtype="float32", num_kv_blocks=64, max_model_len=128)


def front_end(conn, log: list) -> None:
    """Add a request, then one the core must refuse; read until both are
    settled; then stop the core."""
    try:
        log.append(conn.recv())  # CoreFacts
        conn.send(("add", [QueuedRequest("ok", [1, 2, 3], GREEDY, 0, None)]))
        conn.send(("add", [QueuedRequest("long", list(range(1, 200)), GREEDY, 0, None)]))
        tokens: list[int] = []
        settled: dict[str, str] = {}
        while len(settled) < 2 and conn.poll(60):  # a lost answer fails, not hangs
            batch: CoreBatch = conn.recv()
            for out in batch.outputs:
                tokens += out.new_token_ids if out.request_id == "ok" else []
                if out.finish_reason is not None:
                    settled[out.request_id] = out.finish_reason.name
            settled.update(batch.failed)
        log += [tokens, settled]
    finally:
        conn.send(STOP)


def test_the_core_answers_refuses_and_stops_on_its_pipe() -> None:
    parent, child = mp.Pipe()
    log: list = []
    thread = threading.Thread(target=front_end, args=(parent, log))
    thread.start()
    run_core(config(), child)  # returns once told to stop
    thread.join(timeout=60)
    facts, tokens, settled = log
    assert facts == CoreFacts(max_model_len=128, block_size=facts.block_size, kv_root=None)
    assert len(tokens) == 3 and settled["ok"] == FinishReason.LENGTH.name
    assert settled["long"].startswith("ValueError: ") and "128" in settled["long"]


def test_a_core_that_cannot_load_says_why(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(TINY, model)
    cfg = config(model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()  # the config was read; the weights are gone
    parent, child = mp.Pipe()
    run_core(cfg, child)
    reply = parent.recv()
    assert isinstance(reply, StartFailed) and reply.error.startswith(
        ("FileNotFoundError", "ValueError", "OSError")
    ), reply


class GoneProcess:
    """A core process that has exited with code 3."""

    exitcode = 3

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


def receiver(conn) -> CoreProcess:
    """CoreProcess's receiving half alone, on ``conn``."""
    core = CoreProcess.__new__(CoreProcess)
    core._conn, core.process, core.dead, core._stopping = conn, GoneProcess(), None, False
    return core


def test_a_core_that_exits_fails_whoever_waits_with_its_last_stats() -> None:
    ours, theirs = mp.Pipe()
    got: list[CoreBatch] = []
    stats = CoreStats(2, 1, 0.5, 4)
    theirs.send(CoreBatch([], stats))
    theirs.close()  # the core is gone
    core = receiver(ours)
    core._receive(got.append)
    assert core.dead == "the engine core process exited (code 3)"
    assert [b.dead for b in got] == [None, core.dead]
    assert got[-1].stats == stats and got[-1].outputs == []


def test_a_batch_that_says_the_core_died_is_the_last_word() -> None:
    ours, theirs = mp.Pipe()
    got: list[CoreBatch] = []
    theirs.send(CoreBatch([], CoreStats(0, 0, 0.0, 0), dead="RuntimeError: boom"))
    theirs.close()
    core = receiver(ours)
    core._receive(got.append)
    assert core.dead == "RuntimeError: boom" and len(got) == 1  # no second death notice


def test_a_stopping_front_end_is_told_nothing_more() -> None:
    ours, theirs = mp.Pipe()
    got: list[CoreBatch] = []
    theirs.close()
    core = receiver(ours)
    core._stopping = True
    core._receive(got.append)
    assert core.dead is None and got == []
