"""What each weight format costs in quality, on the repository's tiny models.

    python benchmarks/weight_quality.py
    python benchmarks/weight_quality.py --models snippets/models/deepinfer-tiny --tokens 2048

Rows per model, all in bfloat16 compute: bf16 (the checkpoint's weights, the
reference), int8 and int4 quantized at load, and FP8 (the checkpoint quantized in
DeepSeek's block-scaled layout by tests/engine/fp8_checkpoints.py, then loaded as
such). Columns, measured as `deepinfer bench --kv-quality` measures a KV cache
(engine/tools/kv_quality.py, whose functions this reuses): held-out perplexity with
its bootstrap 95% interval and the interval of its gap to bf16, paired window by
window; teacher-forced top-1 agreement with bf16's greedy replies; free-running
greedy agreement; and the bytes of the weights held (every parameter but the
embedding table: what a dense model's decode step reads; a MoE step reads only
its routed experts'). One torch thread, seeded. Not part of
`make test`.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tools.kv_quality import (
    DEFAULT_MODELS,
    Sizes,
    agreement,
    bootstrap,
    drive,
    forced_agreement,
    heldout_text,
    perplexity,
    resamples,
    window_scores,
    windows,
)


@dataclass(frozen=True)
class Weights:
    label: str
    model: Path
    quantization: str | None = None


def fp8_copy(model: Path, folder: Path) -> Path:
    from tests.engine.fp8_checkpoints import quantize_checkpoint

    out = folder / f"{model.name}-fp8"
    out.mkdir()
    for file in model.iterdir():
        if file.is_file():
            (out / file.name).write_bytes(file.read_bytes())
    quantize_checkpoint(out, folder / f"{model.name}-dequantized")
    return out


def weight_bytes(llm: LLM) -> int:
    model = llm.llm_engine.executor.model_runner.model
    return sum(p.nbytes for n, p in model.named_parameters() if "embed_tokens" not in n)


def table(rows: list[Weights], sizes: Sizes) -> list[str]:
    tokenizer = Tokenizer.from_file(str(rows[0].model / "tokenizer.json"))
    scored = windows(tokenizer.encode(heldout_text()[0]).ids, sizes)
    prompts = [w[: sizes.prompt_len] for w in scored[: sizes.num_prompts]]
    draws = resamples(len(scored))
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    greedy = SamplingParams(temperature=0, max_tokens=sizes.gen_tokens, ignore_eos=True)
    lines, first, reference = [], None, None
    for row in rows:
        llm = LLM(row.model, dtype="bfloat16", quantization=row.quantization, seed=0)
        scores = window_scores(drive(llm, scored, score).outputs)
        first = first or scores
        replies = [o.token_ids for o in drive(llm, prompts, greedy).outputs]
        reference = reference or replies
        (lo, hi), (glo, ghi) = bootstrap(scores, first, draws)
        free, _ = agreement(replies, reference)
        forced = forced_agreement(llm, prompts, reference)
        lines.append(
            f"{row.label:>6} {perplexity(scores):8.3f} [{lo:.3f}, {hi:.3f}] "
            f"[{glo:+.3f}, {ghi:+.3f}] {forced:7.3f} {free:7.3f} {weight_bytes(llm) / 2**20:9.2f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(str(m) for m in DEFAULT_MODELS))
    parser.add_argument("--tokens", type=int, default=None, help="held-out tokens (default all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = Sizes(heldout_tokens=args.tokens, gen_tokens=128)
    with tempfile.TemporaryDirectory() as tmp:
        for model in (Path(m) for m in args.models.split(",")):
            rows = [Weights("bf16", model), Weights("int8", model, "int8")]
            rows += [Weights("int4", model, "int4"), Weights("fp8", fp8_copy(model, Path(tmp)))]
            print(
                f"\n{model.name}: held-out perplexity [95%], its gap to bf16 [95%], "
                "top-1 agreement with bf16 forced and free, weight MB held but the embedding"
            )
            print("\n".join(table(rows, sizes)), flush=True)


if __name__ == "__main__":
    main()
