"""Demo: a decode step that reads the KV cache chooses the same token as a
forward pass that recomputes the whole sequence from scratch.

The engine generates 12 tokens the normal way: after the prompt, each step
computes one new token and reads every earlier key and value from the cache.
Then, for each of those steps, a fresh request with the prefix cache off feeds
the whole sequence so far as a prompt, so every key and value is computed
again, and takes one token. The two must agree: the same token, with
log-probabilities within LOGPROB_TOL.
"""

from __future__ import annotations

import os
import textwrap

from engine import LLM, SamplingParams
from engine.runner.cuda_graph import batch_buckets

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
PROMPT = "The scheduler admits a waiting request when"
STEPS = 12
LOGPROB_TOL = 1e-4  # how close the two paths' log-probabilities must be


# The one place this demo reads the engine's internals.
def engine_facts(llm: LLM) -> dict:
    """What the chapter quotes about the engine that only the engine computes:
    the model's size and kind, and the batch sizes it captures CUDA graphs for
    on a GPU (on a CPU it captures none, and this demo runs eagerly)."""
    engine = llm.llm_engine
    params = sum(p.numel() for p in engine.executor.model_runner.model.parameters())
    buckets = batch_buckets(engine.config.max_num_seqs)
    return {
        "model": os.path.basename(MODEL),
        "model_architecture": engine.config.hf_config.architecture,
        "model_parameters": params,
        "model_parameters_million": params / 1e6,
        "cuda_graph_buckets": buckets,
        "cuda_graph_small_buckets": [b for b in buckets if b < buckets[4]],
        "cuda_graph_bucket_step": buckets[5] - buckets[4],
        "cuda_graph_largest_bucket": buckets[-1],
    }


def main() -> dict:
    cached = LLM(MODEL, dtype="float32")
    facts = engine_facts(cached)
    print(f"model: {facts['model']}, {facts['model_parameters']:,} parameters")
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=1)
    out = cached.generate([PROMPT], params, use_tqdm=False)[0]
    prompt_ids = out.prompt_token_ids

    fresh = LLM(MODEL, dtype="float32", enable_prefix_caching=False)
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=1, ignore_eos=True)

    print(f"prompt ({len(prompt_ids)} tokens):")
    print(f"  {PROMPT!r}")
    print(f"{'step':>4} {'context':>7}  {'token, with the cache':<28} recompute")
    print(f"{'':>4} {'':>7}  {'':<28} agrees")
    agree = []
    for i, token in enumerate(out.token_ids):
        again = fresh.generate([prompt_ids + out.token_ids[:i]], one, use_tqdm=False)[0]
        same_token = again.token_ids[0] == token
        close = abs(again.logprobs[0][again.token_ids[0]] - out.logprobs[i][token]) < LOGPROB_TOL
        agree.append(same_token and close)
        agrees = "yes" if same_token and close else f"NO (token {same_token}, logprob {close})"
        text = repr(cached.tokenizer.decode([token]))
        print(f"{i + 1:>4} {len(prompt_ids) + i:>7}  {text:<28} {agrees}")

    computed = cached.stats.prefill_tokens + cached.stats.decode_tokens
    print()
    print(f"tokens computed: {computed} with the cache, {fresh.stats.prefill_tokens} recomputing")
    print(f"text: {out.text!r}")
    print()
    print("on a GPU, decode-only steps replay CUDA graphs")
    print("captured for these batch sizes (none on a CPU):")
    for line in textwrap.wrap(", ".join(map(str, facts["cuda_graph_buckets"])), 50):
        print(f"  {line}")
    return {
        **facts,
        "prompt_tokens": len(prompt_ids),
        "steps": STEPS,
        "last_context": len(prompt_ids) + STEPS - 1,
        "all_agree": all(agree),
        "logprob_tol": LOGPROB_TOL,
        "computed_with_cache": computed,
        "computed_recomputing": fresh.stats.prefill_tokens,
    }


if __name__ == "__main__":
    main()
