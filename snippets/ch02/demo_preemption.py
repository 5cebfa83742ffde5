"""Demo: a KV cache too small for the batch. Requests are preempted and resumed,
none is lost, and every output equals a run with room to spare.

Six short prompts that will each grow by 40 generated tokens share a cache of
11 blocks of 16 tokens, 176 slots, fewer than the six need by the end. The demo
drives the engine step by step and reports each status change: a running
request sent back to the queue (preempted, its blocks freed) and a waiting one
that comes back (resumed, recomputing what is not still in the prefix cache).
"""

import os

from engine import LLM, SamplingParams
from engine.sequence import SequenceStatus

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
PROMPTS = [
    "def free(self, seq):",
    "The prefix cache",
    "class Scheduler:",
    "A block is",
    "# Experiment 5",
    "return tokens",
]
params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

tight = LLM(MODEL, block_size=16, num_kv_blocks=11)
engine = tight.llm_engine
names = [f"r{i}" for i in range(len(PROMPTS))]
for name, prompt in zip(names, PROMPTS):
    engine.add_request(name, prompt, params)

status = {name: SequenceStatus.WAITING for name in names}
kept: dict[str, int] = {}  # tokens a preempted request held when it gave way
outputs, step = {}, 0
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            outputs[out.request_id] = out
    step += 1
    for name in names:
        seq = engine.requests.get(name)
        if seq is None:
            continue
        was, now = status[name], seq.status
        if was is SequenceStatus.RUNNING and now is SequenceStatus.WAITING:
            kept[name] = seq.num_tokens
            print(
                f"step {step:>3}: preempted {name}, its {seq.num_tokens} tokens kept, its blocks freed"
            )
        elif was is SequenceStatus.WAITING and now is SequenceStatus.RUNNING and name in kept:
            print(
                f"step {step:>3}: resumed {name}, {seq.num_cached_tokens} of its {kept.pop(name)} "
                "tokens still in the prefix cache, the rest recomputed"
            )
        status[name] = now

roomy = LLM(MODEL, block_size=16, num_kv_blocks=256)
reference = roomy.generate(PROMPTS, params, use_tqdm=False)

print()
print(
    f"steps: {step}, preemptions: {tight.stats.preemptions}, finished: {len(outputs)} of {len(PROMPTS)}"
)
print(
    f"tokens computed: {tight.stats.prefill_tokens + tight.stats.decode_tokens} with 11 blocks, "
    f"{roomy.stats.prefill_tokens + roomy.stats.decode_tokens} with 256"
)
same = all(outputs[n].token_ids == r.token_ids for n, r in zip(names, reference))
print(f"every output identical to the run with 256 blocks: {same}")
