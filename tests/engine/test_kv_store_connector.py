"""The KV store as a second engine's source of blocks (kv/store_connector.py,
Chapter 8), on a real directory store shared by two engines in one process.

A request one engine prefilled and handed on (kv/handoff.py) continues on the
other with exactly the tokens one engine alone gives, greedy and seeded, on a
dense and an MLA model, with the receiver chunking its prefill or preempting;
its blocks come from the store, not from compute. A store entry that is
corrupt, truncated or gone is counted and recomputed, with the same tokens.
As a second tier of the prefix cache, a stored prefix is loaded only when
loading is estimated to be cheaper. A handoff from another key space is refused."""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.kv import store_connector
from engine.kv.handoff import Handoff

BLOCK = 4


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(9, 70))] for _ in range(n)]


def engine(model: Path, store: Path | None, **kw) -> LLM:
    store_kw = {} if store is None else dict(kv_store=str(store))
    base = dict(block_size=BLOCK, num_kv_blocks=256, dtype="float32", attention_backend="torch")
    return LLM(model=str(model), **(base | store_kw | kw))


def hand_on(sender: LLM, batch: list[list[int]], params: SamplingParams) -> list[Handoff | None]:
    """Each prompt's first token from ``sender``, as a prefill worker hands it on
    (None where that token ends the request)."""
    first = replace(params, max_tokens=1)
    outs = sender.generate(batch, first, use_tqdm=False)
    conn = sender.llm_engine.connector
    handoffs = []
    for prompt, out in zip(batch, outs):
        ended = out.token_ids[-1] in sender.llm_engine.config.hf_config.eos_token_ids
        chain = conn.chain(_Tokens(prompt), len(prompt) // BLOCK)
        handoffs.append(None if ended else Handoff(out.token_ids, 0, chain))
    return handoffs


class _Tokens:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.0),
    SamplingParams(max_tokens=10, temperature=1.0, seed=5),
]


@pytest.mark.parametrize("receiver_kw", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 24}])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_a_handed_on_request_continues_token_identically(
    checkpoint, tmp_path, params, receiver_kw
) -> None:
    arch, path, _ = checkpoint
    batch = prompts(6, seed=1)
    want = [o.token_ids for o in engine(path, None).generate(batch, params, use_tqdm=False)]
    sender = engine(path, tmp_path, role="prefill")
    receiver = engine(path, tmp_path, role="decode", **receiver_kw)
    handoffs = hand_on(sender, batch, params)
    keep = [i for i, h in enumerate(handoffs) if h is not None]
    got = receiver.generate(
        [batch[i] for i in keep], params, use_tqdm=False, handoffs=[handoffs[i] for i in keep]
    )
    assert [o.token_ids for o in got] == [want[i] for i in keep]
    stats = receiver.stats.kv_transfer
    handed = sum(len(batch[i]) // BLOCK * BLOCK for i in keep)
    assert stats.failed_blocks == 0 and stats.loaded_bytes > 0
    if "num_kv_blocks" in receiver_kw:  # a preempted request loads its blocks again
        assert receiver.stats.preemptions > 0
        assert stats.handoff_tokens > handed and stats.loads > len(keep)
    else:
        assert stats.handoff_tokens == handed and stats.loads == len(keep)
    assert_records_add_up(receiver, sender)


def assert_records_add_up(receiver: LLM, sender: LLM) -> None:
    """Each request's load and save, as /metrics observes them, add up to the
    cumulative counts: one load record per load, one save record per saving request."""
    records = receiver.llm_engine.connector.take_records()
    loads = [r for r in records if r.direction == "load"]
    stats = receiver.stats.kv_transfer
    assert len(loads) == stats.loads
    assert sum(r.nbytes for r in loads) == stats.loaded_bytes
    assert sum(r.tokens for r in loads) == stats.hit_tokens
    assert all(r.recompute_seconds_estimate > 0 for r in loads if r.tokens)
    saves = sender.llm_engine.connector.take_records()
    assert saves and all(r.direction == "save" for r in saves)
    assert sum(r.nbytes for r in saves) == sender.stats.kv_transfer.saved_bytes
    assert sum(r.tokens for r in saves) == sender.stats.kv_transfer.saved_blocks * BLOCK
    assert sender.llm_engine.connector.take_records() == []  # taken once


def damage(store: Path, how: str) -> int:
    """Damage every entry in the store directory; how many there were."""
    files = [p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")]
    for p in files:
        data = p.read_bytes()
        if how == "corrupt":
            p.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        elif how == "truncate":
            p.write_bytes(data[: len(data) // 2])
        else:
            p.unlink()
    return len(files)


@pytest.mark.parametrize("how", ["corrupt", "truncate", "delete"])
def test_a_damaged_store_is_counted_and_recomputed(qwen3, tmp_path, how) -> None:
    path, _ = qwen3
    params = PARAMS[0]
    batch = prompts(4, seed=2)
    want = [o.token_ids for o in engine(path, None).generate(batch, params, use_tqdm=False)]
    sender = engine(path, tmp_path, role="prefill")
    handoffs = hand_on(sender, batch, params)
    assert all(h is not None for h in handoffs)
    assert damage(tmp_path, how) > 0
    receiver = engine(path, tmp_path, role="decode")
    got = receiver.generate(batch, params, use_tqdm=False, handoffs=handoffs)
    assert [o.token_ids for o in got] == want
    stats = receiver.stats.kv_transfer
    assert stats.hit_tokens == 0
    backend = receiver.llm_engine.connector.backend_stats()
    if how != "delete":  # listed, then found bad: counted; a deleted one is never offered
        assert stats.failed_blocks == sum(len(p) // BLOCK for p in batch)
        assert backend.corrupt == stats.loads == len(batch)  # each load stops at its first
    else:
        assert backend.corrupt == 0 and stats.loads == 0


def test_the_second_tier_loads_only_when_it_pays(qwen3, tmp_path) -> None:
    path, _ = qwen3
    params = PARAMS[0]
    batch = prompts(4, seed=3)
    first = engine(path, tmp_path)
    want = [o.token_ids for o in first.generate(batch, params, use_tqdm=False)]
    assert first.stats.kv_transfer.saved_blocks > 0
    for compute_seconds, loads in ((1.0, True), (0.0, False)):
        other = engine(path, tmp_path)
        other.llm_engine.connector.cost.compute_seconds_per_token = compute_seconds
        got = [o.token_ids for o in other.generate(batch, params, use_tqdm=False)]
        assert got == want
        stats = other.stats.kv_transfer
        full = sum((len(p) - 1) // BLOCK * BLOCK for p in batch)
        assert (stats.hit_tokens, stats.skipped_tokens) == ((full, 0) if loads else (0, full))
        assert stats.handoff_tokens == 0


def test_a_handoff_from_another_key_space_is_refused(qwen3, tmp_path) -> None:
    path, _ = qwen3
    prompt = prompts(1, seed=4)[0]
    sender = engine(path, tmp_path, kv_cache_dtype="int8")  # another KV format: another root
    [handoff] = hand_on(sender, [prompt], PARAMS[0])
    receiver = engine(path, tmp_path)
    with pytest.raises(ValueError, match="do not match this engine"):
        receiver.generate([prompt], PARAMS[0], use_tqdm=False, handoffs=[handoff])


def test_bad_store_settings_are_refused(qwen3, tmp_path) -> None:
    path, _ = qwen3
    with pytest.raises(ValueError, match="needs kv_store"):
        engine(path, None, role="decode")
    with pytest.raises(ValueError, match="kv_window"):
        engine(path, tmp_path, kv_window=(4, 16))
    with pytest.raises(ValueError, match="role must be"):
        engine(path, tmp_path, role="prefil")


class HeldStore:
    """A store whose puts wait for ``release`` and note the thread they ran in."""

    def __init__(self, store) -> None:
        self.inner, self.release, self.threads = store, threading.Event(), []
        self.stats = store.stats

    def put(self, key: bytes, value: bytes) -> None:
        self.threads.append(threading.current_thread().name)
        assert self.release.wait(timeout=60), "the test never released the store"
        self.inner.put(key, value)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def run_to_end(llm: LLM, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Step the engine itself until every request is finished (no flush)."""
    engine = llm.llm_engine
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    return [done[f"r{i}"] for i in range(len(batch))]


def test_saves_run_beside_the_steps_except_on_a_prefill_worker(qwen3, tmp_path) -> None:
    """A `both` worker's steps finish every request while its saves still wait for
    the store; a prefill worker writes in the step, before its reply could go."""
    path, _ = qwen3
    params = PARAMS[0]
    batch = prompts(3, seed=6)
    want = [o.token_ids for o in engine(path, None).generate(batch, params, use_tqdm=False)]
    llm = engine(path, tmp_path / "both")
    conn = llm.llm_engine.connector
    conn.store = held = HeldStore(conn.store)
    assert run_to_end(llm, batch, params) == want  # no step waited for a put
    assert conn.saving() and llm.stats.kv_transfer.saved_blocks == 0
    held.release.set()
    conn.flush()
    assert not conn.saving() and conn.pending_bytes == 0
    full = sum((len(p) + params.max_tokens - 1) // BLOCK for p in batch)
    assert 0 < llm.stats.kv_transfer.saved_blocks <= full
    assert set(held.threads) == {"kv-store-save_0"}

    prefill = engine(path, tmp_path / "prefill", role="prefill")
    pconn = prefill.llm_engine.connector
    pconn.store = held = HeldStore(pconn.store)
    held.release.set()
    prefill.generate(batch, params, use_tqdm=False)
    assert held.threads and set(held.threads) == {threading.current_thread().name}


def test_saves_past_the_bound_are_dropped_and_counted(qwen3, tmp_path, monkeypatch) -> None:
    path, _ = qwen3
    params = PARAMS[0]
    batch = prompts(4, seed=7)
    want = [o.token_ids for o in engine(path, None).generate(batch, params, use_tqdm=False)]
    llm = engine(path, tmp_path)
    conn = llm.llm_engine.connector
    conn.store = held = HeldStore(conn.store)
    monkeypatch.setattr(store_connector, "MAX_PENDING_SAVE_BYTES", 1)  # none fits
    assert run_to_end(llm, batch, params) == want
    assert llm.stats.kv_transfer.dropped_saves == len(batch) and not conn.saving()
    held.release.set()
    assert held.threads == [] and llm.stats.kv_transfer.saved_blocks == 0
