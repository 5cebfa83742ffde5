"""Sparse selection that depends on the request alone: DeepSeek-V3.2's (DSA) and
V4's indexers keep the same positions for a request alone, crowded, chunked
(V4's chunk boundaries inside a compression window included), preempted and
after a prefix hit, with 2, 4 and 16 indexer heads.

With few heads many positions score exactly 0 (every head closed by the ReLU),
so a query's index_topk-th and next-best scores are often exactly equal.
torch.topk keeps one tied position or another depending on the row's length,
so a chunked prompt kept other positions than a whole one (in transformers as
in the engine before). The engine breaks exact ties by position, the lower
winning (`best_first`), and sums each score in an order fixed by its own row
(`index_scores`). Against transformers, whose choice among ties is arbitrary,
the tests run its model twice: as it is, counting the rows where its top-k
boundary falls on an exact tie, and with its topk keeping the lower positions
among ties, which the engine must match token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.indexer import index_scores, top_positions
from engine.layers.v4_indexer import top_rows, visible_rows
from tests.engine.conftest import build_tokenizer, hf_greedy, random_prompts

MAX_TOKENS = 5
PREFIX = random_prompts(1, seed=81, low=42, high=43)[0]  # shared: a prefix-cache hit
PROMPTS = [PREFIX + p for p in random_prompts(2, seed=82, low=4, high=14)]
PROMPTS += random_prompts(1, seed=83, low=40, high=56)
OTHERS = random_prompts(4, seed=84, low=5, high=40)  # company for the crowded runs


# ---------------------------------------------------------------------------- the rule


def tied_scores(context: int, winners: dict[int, float]) -> tuple[torch.Tensor, ...]:
    """Two heads' queries, weights and keys whose scores are exactly 0 at every
    position but ``winners`` (position -> its one positive dot product): the other
    keys point against every query, so both heads' ReLUs close."""
    keys = torch.zeros(context, 4)
    keys[:, 0] = -1.0
    for pos, dot in winners.items():
        keys[pos, 0] = dot
    q = torch.zeros(context, 2, 4)
    q[..., 0] = 1.0
    return q, torch.full((context, 2), 0.5), keys


def chunkings(context: int) -> Iterator[tuple[int, int]]:
    """(first, n) of every chunk when ``context`` tokens are cut at 1, 5, 13 and all."""
    for size in (1, 5, 13, context):
        for first in range(0, context, size):
            yield first, min(size, context - first)


def test_exact_ties_go_to_the_lower_position() -> None:
    """Three positions score above 0 and every other scores exactly 0, so each
    query's top 8 ends on a tie among the zeros: it keeps the three, best first,
    then its lowest zero positions, however the prompt was chunked."""
    context, k, winners = 40, 8, {30: 2.0, 12: 3.0, 25: 1.0}
    q, w, keys = tied_scores(context, winners)
    for first, n in chunkings(context):
        scores = index_scores(q[first : first + n], w[first : first + n], keys[: first + n], 0.5)
        chosen = top_positions(scores, first, k)
        for j, row in enumerate(chosen.tolist()):
            pos = first + j
            best = sorted((p for p in winners if p <= pos), key=lambda p: -winners[p])
            zeros = [p for p in range(pos + 1) if p not in winners]
            assert scores[j, zeros].eq(0).all() and len(best) + len(zeros) >= min(k, pos + 1)
            expected = (best + zeros)[:k]
            assert row == expected + [-1] * (k - len(expected)), (first, n, pos)


def test_v4_exact_ties_go_to_the_lower_row() -> None:
    """V4's rows: compressed row s is visible from token 4s + 3. Rows 7, 2 and 9
    score above 0, every other exactly 0; chunks end inside the 4-token windows."""
    rows, k, rate, winners = 12, 5, 4, {7: 2.0, 2: 3.0, 9: 1.0}
    q, w, keys = tied_scores(rows * rate, winners)
    keys = keys[:rows]
    for first, n in chunkings(rows * rate):
        positions = torch.arange(first, first + n)
        scores = index_scores(q[first : first + n], w[first : first + n], keys, 0.25)
        chosen = top_rows(scores, visible_rows(positions, rows, rate), k)
        for pos, row in zip(positions.tolist(), chosen.tolist()):
            seen = (pos + 1) // rate
            best = sorted((r for r in winners if r < seen), key=lambda r: -winners[r])
            expected = (best + [r for r in range(seen) if r not in winners])[:k]
            assert row == expected + [-1] * (k - len(expected)), (first, n, pos)


def test_scores_do_not_depend_on_the_step() -> None:
    """A query row's scores are bitwise the same computed alone over its own
    context, in a chunk of 13 rows, and among all 80 rows over the whole context."""
    g = torch.Generator().manual_seed(4)
    q, w = torch.randn(80, 16, 32, generator=g), torch.randn(80, 16, generator=g)
    keys = torch.randn(80, 32, generator=g)
    whole = index_scores(q, w, keys, 0.2)
    for t in range(0, 80, 3):
        alone = index_scores(q[t : t + 1], w[t : t + 1], keys[: t + 1], 0.2)[0]
        first = t // 13 * 13
        end = min(first + 13, 80)
        chunk = index_scores(q[first:end], w[first:end], keys[:end], 0.2)[t - first]
        assert torch.equal(alone, whole[t, : t + 1]), t
        assert torch.equal(chunk[: t + 1], alone), t


# ---------------------------------------------------------------------------- transformers


class TieSpy:
    """Inside transformers' indexers, torch.Tensor.topk counts the query rows whose
    k-th and (k+1)-th best scores are exactly equal (and not masked); with
    ``rule`` it keeps the lower positions among ties, as the engine does."""

    def __init__(self, indexer_type: type) -> None:
        self.indexer_type, self.inside, self.ties, self.rule = indexer_type, False, 0, False
        self.topk = torch.Tensor.topk

    def __call__(self, scores: torch.Tensor, k: int, *args, **kwargs):
        if not self.inside or k >= scores.shape[-1]:
            return self.topk(scores, k, *args, **kwargs)
        values, order = scores.sort(dim=-1, descending=True, stable=True)
        boundary = values[..., k]
        self.ties += int(((values[..., k - 1] == boundary) & (boundary > -1e30)).sum())
        if self.rule:
            return torch.return_types.topk((values[..., :k], order[..., :k]))
        return self.topk(scores, k, *args, **kwargs)

    @contextmanager
    def watching(self, model: torch.nn.Module, rule: bool) -> Iterator[None]:
        modules = [m for m in model.modules() if isinstance(m, self.indexer_type)]
        hooks = [
            m.register_forward_pre_hook(lambda *_: setattr(self, "inside", True)) for m in modules
        ]
        hooks += [
            m.register_forward_hook(lambda *_: setattr(self, "inside", False)) for m in modules
        ]
        self.rule = rule
        torch.Tensor.topk = lambda scores, *args, **kwargs: self(scores, *args, **kwargs)
        try:
            yield
        finally:
            torch.Tensor.topk = self.topk
            for hook in hooks:
                hook.remove()


def transformers_tokens(model: torch.nn.Module, indexer_type: type) -> dict[str, list]:
    """transformers' greedy tokens per prompt, as it is ("plain", with the number of
    indexer rows tied at the top-k boundary, "ties") and with the tie rule ("ruled")."""
    spy, out = TieSpy(indexer_type), {"plain": [], "ties": [], "ruled": []}
    for prompt in PROMPTS:
        spy.ties = 0
        with spy.watching(model, rule=False):
            out["plain"].append(hf_greedy(model, prompt, MAX_TOKENS))
        out["ties"].append(spy.ties)
        with spy.watching(model, rule=True):
            out["ruled"].append(hf_greedy(model, prompt, MAX_TOKENS))
    return out


# ---------------------------------------------------------------------------- the engine


def engine_tokens(
    path: Path, chunks: tuple[int, int], preempt: dict, hit_block: int
) -> dict[str, list]:
    """The prompts' greedy tokens in each kind of company, and the stats that show
    the company was what its name says. The other requests ahead of the prompts
    generate 24 tokens each, so that in a small pool the prompts are preempted.
    The prefix hit runs in blocks of ``hit_block`` tokens."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stats: dict = {}

    def run(name: str, ahead=(), behind=(), first=(), **config) -> list[list[int]]:
        llm = LLM(path, dtype="float32", **config)
        if first:
            llm.generate(list(first), params, use_tqdm=False)
        prompts = [*ahead, *PROMPTS, *behind]
        sampling = [long] * len(ahead) + [params] * (len(PROMPTS) + len(behind))
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        stats[name] = llm.stats
        return [o.token_ids for o in outs][len(ahead) : len(ahead) + len(PROMPTS)]

    tokens = {
        "alone": run("alone", enable_prefix_caching=False, max_num_seqs=1),
        "crowded": run("crowded", OTHERS[:2], OTHERS[2:], enable_prefix_caching=False),
        "preempted": run("preempted", OTHERS, **preempt),
        "prefix hit": run(
            "prefix hit", first=[PREFIX + [7, 8, 9]], max_num_seqs=1, block_size=hit_block
        ),
    }
    for c in chunks:
        tokens[f"chunked by {c}"] = run(c, behind=OTHERS[:1], max_num_batched_tokens=c)
        assert stats[c].partial_prefills > 0, (c, stats[c])
    assert stats["preempted"].preemptions > 0, stats["preempted"]
    assert stats["prefix hit"].prefix_cache_hit_tokens > 0, stats["prefix hit"]
    return tokens


def check(tokens: dict[str, list], hf: dict[str, list], label: str) -> None:
    """Every company gives the tokens alone gives, which are transformers' with the
    tie rule; and transformers' own wherever its top-k boundary met no exact tie."""
    alone = tokens["alone"]
    for name, got in tokens.items():
        assert got == alone, f"{label}: {name} differs from alone"
    assert alone == hf["ruled"], label
    for i, (ours, plain, ties) in enumerate(zip(alone, hf["plain"], hf["ties"])):
        print(f"{label} prompt {i}: {ties} rows tied at transformers' top-k boundary; "
              f"its plain tokens {'equal' if plain == ours else 'differ from'} the engine's")  # fmt: skip
        if ties == 0:
            assert ours == plain, (label, i)


HEADS = [2, 4, 16]


@pytest.mark.parametrize("heads", HEADS)
def test_dsa_selection_depends_on_the_request_alone(heads, tmp_path) -> None:
    import transformers
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    from tests.engine.test_dsa import dsa_config

    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(dsa_config(index_n_heads=heads)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.indexer.k_norm.weight.normal_(1, 0.1)
            layer.self_attn.indexer.k_norm.bias.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    preempt = {"num_kv_blocks": 12, "block_size": 8}
    tokens = engine_tokens(tmp_path, (7, 16), preempt, hit_block=4)
    check(tokens, transformers_tokens(model, DeepseekV32Indexer), f"V3.2, {heads} heads")


@pytest.mark.parametrize("heads", HEADS)
def test_v4_selection_depends_on_the_request_alone(heads, tmp_path) -> None:
    """One CSA layer (compress rate 4, index_topk 4 of its 10 to 15 rows) and one
    sliding layer; chunks of 5 and 13 tokens end inside the compression windows.
    Blocks of 2 tokens make row spans of 40 tokens: the prefix hit is one span."""
    import transformers
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    from tests.engine.test_deepseek_v4 import CSA, HCA, SLIDING, randomize, v4_config

    torch.manual_seed(0)
    config = v4_config(
        layer_types=[CSA, SLIDING],
        mlp_layer_types=["hash_moe", "moe"],
        hc_mult=2,
        sliding_window=8,
        compress_rates={CSA: 4, HCA: 8},
        index_n_heads=heads,
    )
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    randomize(model, seed=1)
    model.save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    preempt = {"num_kv_blocks": 5, "block_size": 16}
    tokens = engine_tokens(tmp_path, (5, 13), preempt, hit_block=2)
    check(tokens, transformers_tokens(model, DeepseekV4Indexer), f"V4, {heads} heads")
