"""A step that checks several tokens per request: the scheduler carries the
drafts the model runner's proposer made after a request's newest token (handed
back with the step before's tokens), the model runner samples
at every position that can yield a token and accepts drafts left to right
while they match, and the scheduler keeps the accepted ones, rolls the rest
back and never offers a block holding a rejected draft to the prefix cache.

Strict-match acceptance with a random stream indexed by output position gives
exactly the tokens of decoding without drafts, greedy and seeded alike,
whatever the drafts are: all right, all wrong, or half right."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata, decode_query_len
from engine.kv.block_manager import BlockManager
from engine.outputs import LogprobsTensors, ModelRunnerOutput
from engine.runner.compiled_decode import CompiledDecode
from engine.runner.drafting import TokenDrafts
from engine.sample.rejection_sampler import DraftCheck
from engine.sched.async_scheduler import AsyncScheduler
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence
from engine.spec_decode import Draft, DraftProposer, DraftRequest
from engine.stats import EngineStats
from tests.engine.conftest import EOS, VOCAB, random_prompts

PROMPTS = random_prompts(4, seed=21, low=3, high=20)
MAX_TOKENS = 16


class ReferenceProposer:
    """Drafts from a no-draft run's outputs (by prompt): the next ``k`` tokens,
    each made wrong from index ``right`` on (right=k: all right; 0: all wrong)."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], k: int, right: int) -> None:
        self.outputs, self.k, self.right = outputs, k, right
        self.proposed = 0

    def propose(self, seqs: list[DraftRequest]) -> dict[str, Draft]:
        drafts = {}
        for seq in seqs:
            ref = self.outputs[tuple(seq.prompt_token_ids)]
            o = seq.num_output_tokens
            assert seq.output_token_ids == ref[:o], "a draft was accepted wrongly"
            nxt = ref[o : o + self.k]
            drafts[seq.request_id] = Draft(
                [t if i < self.right else (t + 1) % VOCAB for i, t in enumerate(nxt)]
            )
            self.proposed += len(drafts[seq.request_id])
        return drafts

    def forget(self, req_ids: list[str]) -> None:
        pass


def use_proposer(llm: LLM, proposer: DraftProposer) -> None:
    """Draft with ``proposer`` in the engine's model runner, as a speculative_config's would."""
    runner = llm.llm_engine.executor.model_runner
    runner.drafter = TokenDrafts(proposer, runner.input_batch.requests)


def run(path, params: SamplingParams, proposer=None, **kwargs) -> tuple[LLM, list]:
    llm = LLM(path, dtype="float32", **kwargs)
    if proposer is not None:
        use_proposer(llm, proposer)
    return llm, llm.generate(PROMPTS, params, use_tqdm=False)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, logprobs=2)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k,right", [(3, 3), (3, 0), (4, 2)], ids=["right", "wrong", "half"])
def test_drafts_give_the_tokens_of_decoding_without_them(qwen3, params, k, right) -> None:
    path, _ = qwen3
    plain_llm, plain = run(path, params, seed=5)
    outputs = {tuple(o.prompt_token_ids): o.token_ids for o in plain}
    proposer = ReferenceProposer(outputs, k, right)
    llm, drafted = run(path, params, proposer, seed=5)
    assert proposer.proposed > 0
    for a, b in zip(plain, drafted):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert [sorted(d) for d in b.logprobs] == [sorted(d) for d in a.logprobs]
        for x, y in zip(a.logprobs, b.logprobs):
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    if right == k:  # every draft accepted: fewer forward passes for the same tokens
        assert llm.stats.steps < plain_llm.stats.steps
    if right == 0:  # none accepted: one token per step, as without drafts
        assert llm.stats.steps == plain_llm.stats.steps


def test_no_rejected_draft_reaches_the_prefix_cache(qwen3) -> None:
    """Wrong drafts fill whole blocks; a later request whose prompt is an earlier
    request's prompt and output hits its published blocks, and still gets the
    tokens it gets without any drafts anywhere."""
    path, _ = qwen3
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    first = PROMPTS[0]
    kwargs = dict(seed=5, block_size=2, enable_prefix_caching=True)
    llm = LLM(path, dtype="float32", **kwargs)
    [plain] = llm.generate([first], params, use_tqdm=False)
    outputs = {tuple(first): plain.token_ids}
    second = first + plain.token_ids + [7]
    [expected] = llm.generate([second], params, use_tqdm=False)

    llm = LLM(path, dtype="float32", **kwargs)
    use_proposer(llm, ReferenceProposer(outputs, 5, 1))
    [drafted] = llm.generate([first], params, use_tqdm=False)
    assert drafted.token_ids == plain.token_ids
    use_proposer(llm, Fixed([]))  # no drafts for it
    hits = llm.stats.prefix_cache_hit_tokens
    [again] = llm.generate([second], params, use_tqdm=False)
    assert llm.stats.prefix_cache_hit_tokens - hits >= len(first) + 14  # it read those blocks
    assert again.token_ids == expected.token_ids


def scheduler(block_size: int = 4, **kwargs) -> Scheduler:
    bm = BlockManager(16, block_size, enable_prefix_caching=True)
    return Scheduler(8, 64, bm, EngineStats(), eos_token_ids=[EOS], **kwargs)


class Fixed:
    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, seqs: list[DraftRequest]) -> dict[str, Draft]:
        return {seq.request_id: Draft(self.drafts) for seq in seqs}

    def forget(self, req_ids: list[str]) -> None:
        pass


def fold(sched: Scheduler, rows: dict[str, list[int]], drafts: dict[str, list[int]] | None = None):
    """One step whose model samples ``rows[req_id]`` at the request's positions,
    with acceptance done as the runner does it, and whose proposer then drafts
    ``drafts[req_id]`` after the request's newest token, for its next step."""
    out = sched.schedule()
    items = [item for item in out.scheduled if item.samples]
    flat = torch.tensor([t for item in items for t in rows[item.req_id]])
    width = max(item.num_drafts for item in items)
    counts = [1 + item.num_drafts for item in items]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    check = DraftCheck(
        torch.tensor([it.draft_token_ids + [-1] * (width - it.num_drafts) for it in items]),
        torch.tensor([[s + min(j, n - 1) for j in range(width)] for s, n in zip(starts, counts)]),
    )
    accepted = check.num_accepted(flat) if width else None
    output = ModelRunnerOutput([it.req_id for it in items], flat, None, counts, accepted)
    if drafts is not None:
        output.draft_token_ids = [drafts.get(it.req_id, []) for it in items]
    return out, sched.update_from_output(out, output)


def test_rejected_drafts_roll_back_and_free_their_blocks() -> None:
    sched = scheduler()
    seq = Sequence("a", [10, 11, 12], SamplingParams(max_tokens=50))
    sched.add(seq)
    drafts = {"a": [30, 31, 32, 33]}  # positions 4..7 at the next step: all of block 1
    fold(sched, {"a": [20]}, drafts)  # the prompt, then its first token at position 3
    out, [news] = fold(sched, {"a": [40, 41, 42, 43, 44]}, drafts)  # the first draft is wrong
    [item] = out.scheduled
    assert item.token_ids == [20, 30, 31, 32, 33] and item.num_drafts == 4
    assert news.new_token_ids == [40]
    assert seq.token_ids == [10, 11, 12, 20, 40]
    assert seq.num_computed_tokens == 4  # 40 is still to be computed
    assert len(seq.block_table) == 1  # block 1 held only rejected drafts
    assert sched.block_manager.num_free_blocks == 15
    assert len(sched.block_manager.cached_blocks) == 1  # block 0 alone, all real tokens
    # Half right: two accepted, then the token sampled after them.
    out, [news] = fold(sched, {"a": [30, 31, 50, 51, 52]}, drafts)
    assert news.new_token_ids == [30, 31, 50]
    assert seq.token_ids == [10, 11, 12, 20, 40, 30, 31, 50]
    assert seq.num_computed_tokens == 7
    assert len(sched.block_manager.cached_blocks) == 1  # block 1 is not full of computed ones
    out, _ = fold(sched, {"a": [60, 61, 62, 63, 64]})
    assert out.scheduled[0].num_computed_tokens == 7  # the rejected ones are computed again
    assert len(sched.block_manager.cached_blocks) == 2
    assert sched.stats.decode_tokens == 15  # three decodes of 1 + 4 tokens each


def test_a_row_stops_at_eos_and_drafts_stop_short_of_max_tokens() -> None:
    sched = scheduler()
    seq = Sequence("a", [10, 11, 12], SamplingParams(max_tokens=4))
    sched.add(seq)
    fold(sched, {"a": [20]}, {"a": [30, 31, 32, 33, 34]})
    out, [news] = fold(sched, {"a": [30, 31, 32]})
    assert out.scheduled[0].draft_token_ids == [30, 31]  # 1 + 2 + 1 reaches max_tokens
    assert news.new_token_ids == [30, 31, 32] and news.finish_reason == "length"
    seq = Sequence("b", [10, 11, 12], SamplingParams(max_tokens=40))
    sched.add(seq)
    fold(sched, {"b": [20]}, {"b": [30, EOS, 32]})
    _, [news] = fold(sched, {"b": [30, EOS, 32, 33]})
    assert news.new_token_ids == [30, EOS] and news.finish_reason == "stop"
    assert sched.stats.generated_tokens == 1 + 3 + 1 + 2
    assert sched.block_manager.num_free_blocks == 16


def test_async_scheduling_refuses_drafts() -> None:
    bm = BlockManager(16, 4)
    sched = AsyncScheduler(8, 64, bm, EngineStats())
    sched.add(Sequence("a", [10, 11], SamplingParams()))
    out = sched.schedule()  # a prompt, whose step then comes back with a draft
    drafted = ModelRunnerOutput(["a"], torch.tensor([5]), None, draft_token_ids=[[1]])
    sched.update_from_output(out, drafted)
    with pytest.raises(ValueError, match="async_scheduling=False"):
        sched.schedule()


def test_decodes_have_one_definition(qwen3) -> None:
    """The runner orders decodes with drafts first and says their query length;
    the backends' one-token decode path, CUDA graphs and the compiled decode
    see them as no decodes of one token."""
    path, _ = qwen3
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.9, max_tokens=8))
    engine.step()  # both prompts
    engine.add_request("2", PROMPTS[2], SamplingParams(temperature=0.9, max_tokens=8))
    for seq in engine.scheduler.running:  # as if the runner's proposer had made them
        seq.spec_token_ids, seq.spec_at = [7, 8], seq.num_tokens
    out = engine.scheduler.schedule()
    runner = engine.executor.model_runner
    step = runner.prepare_inputs(out)
    meta = step.batch.meta
    assert meta.decode_query_len == decode_query_len(2) == 3
    assert meta.query_lens_cpu == [3, 3, len(PROMPTS[2])]  # decodes first
    assert meta.num_decodes == 0 and not meta.decodes_only()
    assert not CompiledDecode.can_run(meta)
    assert step.batch.num_positions() == [3, 3, 1]
    assert len(step.batch.logits_indices) == 7
    # Each row draws at its token's output position.
    assert step.sampling.random.steps.tolist() == [1, 2, 3, 1, 2, 3, 0]
    logits = runner.forward(step)
    hidden = runner.sampled_hidden_states  # for a proposer: one per sampled row
    assert hidden.shape[0] == logits.shape[0] == 7
    assert torch.equal(runner.model.compute_logits(hidden).float(), logits)
    one = AttentionMetadata(*[meta.slot_mapping] * 4, num_decodes=2, query_lens_cpu=[1, 1])
    assert one.decodes_only() and CompiledDecode.can_run(one)


def test_token_rows_cut_each_request_at_its_accepted_drafts() -> None:
    tokens = torch.tensor([5, 6, 7, 8, 9, 1])
    logprobs = LogprobsTensors(tokens[:, None], torch.arange(6.0)[:, None])
    out = ModelRunnerOutput(["a", "b", "c"], tokens, logprobs, [3, 2, 1], torch.tensor([1, 1, 0]))
    rows = out.token_rows()
    assert [r.token_ids for r in rows] == [[5, 6], [8, 9], [1]]
    assert [r.num_accepted for r in rows] == [1, 1, 0]
    assert rows[1].logprobs == [([8], [3.0]), ([9], [4.0])]
    plain = ModelRunnerOutput(["a", "b"], torch.tensor([3, 4]))
    assert [r.token_ids for r in plain.token_rows()] == [[3], [4]]


def test_acceptance_stops_at_the_first_mismatch() -> None:
    """Rows of the sampled tokens [5, 6, 7, 8 | 1, 2]: the first request's drafts
    are checked against rows 0..2, the second's (one draft, padded) against row 4."""
    sampled = torch.tensor([5, 6, 7, 8, 1, 2])
    check = DraftCheck(
        torch.tensor([[5, 9, 7], [1, -1, -1]]),  # 9 is wrong; 7 after it would match
        torch.tensor([[0, 1, 2], [4, 5, 5]]),
    )
    assert check.num_accepted(sampled).tolist() == [1, 1]
    check.drafts[0, 1] = 6
    assert check.num_accepted(sampled).tolist() == [3, 1]
