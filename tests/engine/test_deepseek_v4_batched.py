"""DeepSeek-V4's decodes batched: a step's one-token queries attend, and CSA's
indexer scores, all at once over contexts padded to the longest
(V4Attention.attend_decodes, V4Indexer.decode_rows), where prompts and
verify steps still go one sequence at a time. Checked during real steps,
against the one-at-a-time path on the same inputs: the indexer keeps exactly
the same rows (the same products summed in the same order), and attention
agrees to float32 rounding. test_deepseek_v4.py holds the token oracle."""

from __future__ import annotations

import pytest
import torch

import engine.layers.v4_attention as v4_attention
import engine.layers.v4_indexer as v4_indexer
from engine.layers.seq_spans import SeqSpan
from tests.engine.conftest import random_prompts
from tests.engine.test_deepseek_v4 import checkpoint_of, generate

PROMPTS = random_prompts(5, seed=12, low=30, high=90)


@pytest.fixture(scope="module")
def three_types(tmp_path_factory):
    return checkpoint_of("three-types", tmp_path_factory)


def test_batched_decodes_equal_one_at_a_time(three_types, monkeypatch) -> None:
    seen = {"attention": 0, "rows": 0, "chosen": 0, "indexer": 0}
    attend_decodes = v4_attention.V4Attention.attend_decodes
    decode_rows = v4_indexer.V4Indexer.decode_rows

    def checked_attention(self, q, spans: list[SeqSpan], meta, chosen):
        out = attend_decodes(self, q, spans, meta, chosen)
        for i, span in enumerate(spans):
            picks = None if chosen is None else chosen[i : i + 1]
            alone = self.attend(q[i : i + 1], span, meta, picks)
            torch.testing.assert_close(out[i : i + 1], alone, rtol=1e-5, atol=1e-6)
        seen["attention"] += 1
        seen["rows"] += self.compressor is not None and max(s.end for s in spans) >= self.rate
        seen["chosen"] += chosen is not None
        return out

    def checked_rows(self, q, w, spans: list[SeqSpan], meta, index_keys):
        out = decode_rows(self, q, w, spans, meta, index_keys)
        for i, span in enumerate(spans):
            rows = torch.arange(span.end // self.rate)
            where = v4_indexer.row_slots(
                meta.group_tables[v4_indexer.ROW_GROUP][span.seq], rows, index_keys
            )
            keys = v4_indexer.read(index_keys, where)
            scores = v4_indexer.index_scores(q[i : i + 1], w[i : i + 1], keys, self.dim**-0.5)
            visible = v4_indexer.visible_rows(span.positions(q.device), len(rows), self.rate)
            assert torch.equal(out[i], v4_indexer.top_rows(scores, visible, self.topk)[0])
        seen["indexer"] += 1
        return out

    monkeypatch.setattr(v4_attention.V4Attention, "attend_decodes", checked_attention)
    monkeypatch.setattr(v4_indexer.V4Indexer, "decode_rows", checked_rows)
    _, path, _ = three_types
    batched, _ = generate(path, PROMPTS, max_num_batched_tokens=40)
    assert min(seen.values()) > 0, seen  # raw rows, compressed rows and chosen ones all ran
    monkeypatch.setattr(v4_attention, "one_token_spans", lambda spans: ([], spans))
    monkeypatch.setattr(v4_indexer, "one_token_spans", lambda spans: ([], spans))
    alone, _ = generate(path, PROMPTS, max_num_batched_tokens=40)
    assert batched == alone


@pytest.mark.parametrize("n", [0, 1, 3])
def test_one_token_spans_batch_two_or_more(n: int) -> None:
    spans = [SeqSpan(i, slice(i, i + 1), 9, 10) for i in range(n)]
    spans.append(SeqSpan(n, slice(n, n + 4), 0, 4))  # a prompt chunk
    decodes, others = v4_attention.one_token_spans(spans)
    assert (len(decodes), len(others)) == ((n, 1) if n >= 2 else (0, n + 1))
