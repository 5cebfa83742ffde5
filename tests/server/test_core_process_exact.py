"""The core process's handle and its two message loops pinned to exact values
(issue 49): one real core process spawned and stopped (a few seconds on
deepinfer-tiny), then each message, each failure to start and each stop step
on fakes, so that a mutant in any of them fails a test here in process."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.core.request_checker import BlockChain
from engine.entrypoints import core_process
from engine.entrypoints.core_process import (
    STOP,
    STOP_TIMEOUT_S,
    CoreProcess,
    QueuedRequest,
    StartFailed,
    _read,
    run_core,
)
from engine.entrypoints.engine_core import CoreBatch, CoreFacts, CoreStats
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from tests.server.test_core_process_in_process import config

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def test_a_spawned_core_answers_aborts_and_stops_cleanly(tmp_path: Path) -> None:
    cfg = config()
    cfg.kv_store, cfg.disable_any_whitespace = str(tmp_path / "store"), True
    core = CoreProcess(cfg)
    try:
        assert core.process.name == "deepinfer-core" and not core.process.daemon
        assert isinstance(core.process, mp.context.SpawnProcess)  # a fresh interpreter
        facts = core.facts
        assert (facts.max_model_len, type(facts.kv_root)) == (128, bytes)  # the store's root
        checker = core.checker
        assert (checker.vocab_size, checker.max_model_len, checker.seed) == (
            cfg.hf_config.vocab_size,
            128,
            cfg.seed,
        )
        assert checker.store_chain == BlockChain(facts.kv_root, facts.block_size)
        assert checker.num_added == 0 and core.tokenizer is not None
        assert checker.tokenizer is core.tokenizer
        grammars = checker.structured_output
        assert grammars.tokenizer is core.tokenizer and grammars.disable_any_whitespace is True
        assert grammars.vocab_size == cfg.hf_config.vocab_size
        assert grammars.eos_token_ids == list(cfg.hf_config.eos_token_ids)
        assert core.dead is None and core._receiver is None and not core._stopping
        assert not core.alive  # not receiving yet
        tokens: dict[str, list[int]] = {"ok": [], "long": [], "tail": []}
        ends: dict[str, CoreBatch] = {}
        ended = {"ok": threading.Event(), "tail": threading.Event()}

        def deliver(batch: CoreBatch) -> None:
            for out in batch.outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    ends[out.request_id] = batch
                    ended[out.request_id].set()

        core.start(deliver)
        assert core._receiver.name == "core-receiver" and core._receiver.daemon
        assert core.alive
        seqs = [core.make_sequence("ok", [1, 2, 3], GREEDY)]
        seqs.append(core.make_sequence("long", [4, 5, 6], LONG))
        core.add(seqs)
        assert checker.num_added == 2
        assert ended["ok"].wait(60), tokens
        assert len(tokens["ok"]) == 3 and ends["ok"].outputs[0].finish_reason == FinishReason.LENGTH
        core.abort(["long"])  # in order: the abort reaches the core before "tail" does
        core.add([core.make_sequence("tail", [7, 8], GREEDY)])
        assert ended["tail"].wait(60), tokens
        assert (ends["tail"].stats.num_running, ends["tail"].stats.num_waiting) == (0, 0)
        assert "long" not in ends and len(tokens["long"]) < 100  # aborted, not finished
    finally:
        core.stop()
    assert core._stopping and core.process.exitcode == 0  # told to stop, not terminated
    assert core._conn.closed and not core.alive and core.dead is None


class FakeProcess:
    """A core process: gone (code 3), or one that never exits until terminated."""

    def __init__(self, alive: bool = False) -> None:
        self.exitcode = None if alive else 3
        self.live = alive
        self.calls: list[tuple] = []

    def join(self, timeout: float | None = None) -> None:
        self.calls.append(("join", timeout))

    def is_alive(self) -> bool:
        return self.live

    def terminate(self) -> None:
        self.calls.append(("terminate",))
        self.live, self.exitcode = False, -15


def handle(conn, process: FakeProcess | None = None) -> CoreProcess:
    core = CoreProcess.__new__(CoreProcess)
    core._conn, core.process = conn, process or FakeProcess()
    core.dead, core._stopping, core._receiver = None, False, None
    core._send_lock = threading.Lock()
    return core


def test_a_core_that_exits_before_it_is_ready_is_a_runtime_error() -> None:
    ours, theirs = mp.Pipe()
    theirs.close()
    core = handle(ours)
    with pytest.raises(RuntimeError) as err:
        core._first_reply()
    assert str(err.value) == "the engine core process exited with code 3 before it was ready"
    assert core.process.calls == [("join", None)]


def test_a_core_that_could_not_start_says_why() -> None:
    ours, theirs = mp.Pipe()
    theirs.send(StartFailed("OSError: no weights"))
    core = handle(ours)
    with pytest.raises(RuntimeError) as err:
        core._first_reply()
    assert str(err.value) == "the engine core could not start: OSError: no weights"
    assert core.process.calls == [("join", None)]
    facts = CoreFacts(max_model_len=64, block_size=16, kv_root=b"r")
    theirs.send(facts)
    assert core._first_reply() == facts


def test_requests_and_aborts_cross_the_pipe_as_sent() -> None:
    ours, theirs = mp.Pipe()
    core = handle(ours)
    core.checker = SimpleNamespace(num_added=5)
    seqs = [
        SimpleNamespace(
            request_id=f"r{i}",
            prompt_token_ids=[i, 7],
            params=GREEDY,
            seed=10 + i,
            handoff=[None, "h"][i],
        )
        for i in range(2)
    ]
    core.add(seqs)
    core.abort(["r1"])
    assert core.checker.num_added == 7
    assert theirs.recv() == (
        "add",
        [
            QueuedRequest("r0", [0, 7], GREEDY, 10, None),
            QueuedRequest("r1", [1, 7], GREEDY, 11, "h"),
        ],
    )
    assert theirs.recv() == ("abort", ["r1"])
    theirs.close()
    core.abort(["r0"])  # the core is gone: the receiver says so, the sender does not raise
    core.abort(["r0"])


def test_alive_needs_the_receiver_the_process_and_no_death() -> None:
    core = handle(None, FakeProcess(alive=True))
    running = SimpleNamespace(is_alive=lambda: True)
    assert not core.alive
    core._receiver = running
    assert core.alive
    core._receiver = SimpleNamespace(is_alive=lambda: False)
    assert not core.alive
    core._receiver, core.process.live = running, False
    assert not core.alive
    core.process.live, core.dead = True, "RuntimeError: boom"
    assert not core.alive


def test_a_core_that_will_not_stop_is_terminated() -> None:
    ours, theirs = mp.Pipe()
    process = FakeProcess(alive=True)
    core = handle(ours, process)
    core.stop()
    assert theirs.recv() == STOP == "stop"
    assert process.calls == [("join", 30.0), ("terminate",), ("join", 30.0)]
    assert STOP_TIMEOUT_S == 30.0 and core._stopping and ours.closed
    gone = FakeProcess()
    core = handle(mp.Pipe()[0], gone)
    core.stop()
    assert gone.calls == [("join", 30.0)]


class FakeCore:
    """EngineCore as _read drives it: every call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.engine = SimpleNamespace(make_sequence=self.make_sequence)

    def make_sequence(self, request_id, tokens, params, handoff, seed):
        if not tokens:
            raise ValueError("the prompt is empty")
        return (request_id, tokens, params, handoff, seed)

    def add(self, seqs) -> None:
        self.calls.append(("add", seqs))

    def abort(self, ids) -> None:
        self.calls.append(("abort", ids))

    def reject(self, failures) -> None:
        self.calls.append(("reject", failures))

    def stop_soon(self) -> None:
        self.calls.append(("stop",))


def read_until_stopped(core: FakeCore, conn) -> None:
    """_read in a thread of its own: an inbox that never stops fails in seconds."""
    reader = threading.Thread(target=_read, args=(core, conn), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the inbox did not stop"


def test_the_core_inbox_builds_requests_rejects_bugs_and_stops() -> None:
    ours, theirs = mp.Pipe()
    ours.send(
        ("add", [QueuedRequest("a", [1], GREEDY, 9, None), QueuedRequest("b", [], GREEDY, 3, None)])
    )
    ours.send(("abort", ["a"]))
    ours.send(("add", [QueuedRequest("c", [2], GREEDY, 4, "handoff-c")]))
    ours.send(STOP)
    core = FakeCore()
    read_until_stopped(core, theirs)
    assert core.calls == [
        ("add", [("a", [1], GREEDY, None, 9)]),
        ("reject", [("b", "ValueError: the prompt is empty")]),
        ("abort", ["a"]),
        ("add", [("c", [2], GREEDY, "handoff-c", 4)]),
        ("stop",),
    ]
    ours.close()
    core = FakeCore()
    read_until_stopped(core, theirs)  # the front end is gone
    assert core.calls == [("stop",)]


def test_a_core_that_cannot_load_logs_at_the_front_ends_level_and_ignores_ctrl_c(
    tmp_path: Path, monkeypatch
) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(config().model, model)
    cfg = config(model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    levels: list[str] = []
    monkeypatch.setattr(core_process.logs, "configure", levels.append)
    before = signal.getsignal(signal.SIGINT)
    parent, child = mp.Pipe()
    try:
        run_core(cfg, child, logging.DEBUG)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    other, other_child = mp.Pipe()
    run_core(cfg, other_child)
    assert levels == ["DEBUG", "WARNING"] and isinstance(other.recv(), StartFailed)
    reply = parent.recv()
    kind, _, why = reply.error.partition(": ")
    assert kind in ("FileNotFoundError", "ValueError", "OSError") and why, reply


def test_the_core_reads_its_inbox_in_a_daemon_thread_named_core_inbox() -> None:
    parent, child = mp.Pipe()
    seen: list[bool] = []

    def front_end() -> None:
        try:
            parent.recv()  # CoreFacts: the reader starts right after
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                seen.extend(t.daemon for t in threading.enumerate() if t.name == "core-inbox")
                time.sleep(0.01)
        finally:
            parent.send(STOP)

    thread = threading.Thread(target=front_end)
    thread.start()
    before = signal.getsignal(signal.SIGINT)
    try:
        run_core(config(), child)
    finally:
        signal.signal(signal.SIGINT, before)
    thread.join(30)
    assert seen == [True]  # a daemon: a front end gone mid-read cannot keep the core alive


def test_a_sequence_is_made_by_the_front_ends_checker_with_its_handoff() -> None:
    core = handle(None)
    core.checker = SimpleNamespace(check=lambda *args: args)
    assert core.make_sequence("r", [1, 2], GREEDY, "handoff") == ("r", [1, 2], GREEDY, "handoff")
    assert core.make_sequence("r", [1, 2], GREEDY) == ("r", [1, 2], GREEDY, None)


def test_a_core_that_dies_before_its_first_batch_reports_zero_stats(caplog) -> None:
    ours, theirs = mp.Pipe()
    theirs.close()
    core = handle(ours)
    got: list[CoreBatch] = []
    with caplog.at_level(logging.ERROR, logger="deepinfer.server"):
        core._receive(got.append)
    assert core.process.calls == [("join", 5)]  # a moment for its exit code
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "the engine core process exited (code 3)")
    ]
    assert [b.stats for b in got] == [CoreStats(0, 0, 0.0, 0)]
    assert got[0].dead == "the engine core process exited (code 3)" and got[0].outputs == []
