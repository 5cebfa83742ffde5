"""Demo: one model's weights in four formats, what a decode step reads, and what
each costs in quality.

deepinfer-tiny's checkpoint is rounded to bf16, the reference: two bytes a
weight. From it the demo writes every linear layer in DeepSeek's block-scaled
FP8 layout (FP8 E4M3 values, one float32 weight_scale_inv per 128 x 128 block,
the block's largest magnitude over 448, and config.json's quantization_config),
which the engine loads as it loads DeepSeek's own; and once more with every
block of a weight given the same scale, the whole tensor's largest magnitude
over 448: per-tensor scaling, in the same layout. int8 and int4 are made by the
engine from the bf16 checkpoint at load (LLM(quantization=...)).

First, the bytes one decode step reads at batch 1, counted from the tensors of
each model as the engine holds it in bfloat16: every parameter whole (the tied
output head reads the whole embedding table) and, were the embedding table not
shared, one row of it. Integers, exact. Bytes per weight are over the quantized
linear layers, codes and scales together, to BPW_PLACES places.

Then quality, in float32 so that only the weights differ: the perplexity of
HELDOUT held-out tokens (the book's Chapter 1 as the tiny models' training left
it out, in windows of 256 tokens) with the 95% interval of a bootstrap over the
windows, the interval of its gap to bf16 (the same windows resampled for every
row), and teacher-forced top-1 agreement with bf16's greedy replies (GEN
tokens after each of 4 prompts). The FP8 rows run the engine's FP8 layers.
The same quality table follows for deepinfer-tiny-moe (DeepSeek-V3's shape:
MLA, a shared expert and routed experts, every one of their linear layers in
FP8 as DeepSeek ships them), in bf16 and its two FP8 copies.
The int8 and int4 rows run the weights the engine's own quantizer makes (the
tied embedding table in int8 under both), dequantized by its own functions, as
a float32 checkpoint, so that the rows score the formats and not the kernels;
CHECK_TOKENS greedy tokens a prompt then show that the engine's int8 and int4
layers give the same tokens as those weights. Perplexities are rounded to
FIGURES significant figures, gaps to one place more, shares to three places.
On one torch thread.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn

from engine import LLM, SamplingParams
from engine.layers.quantization.int_weight import (
    int4_dequantize,
    int4_group,
    int4_quantize,
    int8_dequantize,
    int8_quantize,
)
from engine.tools.kv_quality import (
    LEVEL,
    Sizes,
    bootstrap,
    drive,
    forced_agreement,
    heldout_text,
    perplexity,
    resamples,
    window_scores,
    windows,
)

MODEL = Path("snippets/models/deepinfer-tiny")
MOE = Path("snippets/models/deepinfer-tiny-moe")
BLOCK, FP8_MAX = 128, 448.0  # DeepSeek's weight_block_size; E4M3's largest value
FIGURES, BPW_PLACES = 4, 5
HELDOUT, GEN, CHECK_TOKENS = 4864, 128, 32  # 19 windows of 256 tokens


def fp8_blocks(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's rule for a weight: one float32 scale per 128 x 128 block, the
    block's largest magnitude over 448 (1 for an all-zero block), and the FP8
    codes w / scale. per_tensor: every block gets the whole tensor's scale."""
    rows, cols = w.shape
    grid_rows, grid_cols = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(grid_rows * BLOCK, grid_cols * BLOCK, dtype=torch.float64)
    padded[:rows, :cols] = w.double().abs()
    amax = padded.view(grid_rows, BLOCK, grid_cols, BLOCK).amax(dim=(1, 3))
    if per_tensor:
        amax = amax.max().expand_as(amax)
    scales = torch.where(amax > 0, amax / FP8_MAX, 1.0).float()
    each = scales.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    codes = (w.double() / each.double()).clamp(-FP8_MAX, FP8_MAX)
    return codes.to(torch.float8_e4m3fn), scales


def int_weights(w: torch.Tensor, method: str) -> torch.Tensor:
    """The weight that the engine's int8 or int4 layer multiplies by, in a float32
    model: its quantizer's codes times their scales."""
    if method == "int8":
        return int8_dequantize(*int8_quantize(w.float(), torch.float32))
    return int4_dequantize(*int4_quantize(w.float(), int4_group(w.shape[1]), torch.float32))


def save(folder: Path, tensors: dict, config: dict, model: Path = MODEL) -> Path:
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model / name, folder / name)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def write_checkpoints(folder: Path, model: Path = MODEL, ints: bool = True) -> dict[str, Path]:
    """bf16; FP8 with block and with per-tensor scales; int8's and int4's weights
    (``ints``)."""
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(model / "model.safetensors").items()}
    linears = [name for name in bf16 if name.endswith("proj.weight")]
    config = json.loads((model / "config.json").read_text()) | {"dtype": "bfloat16"}
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    fp8_config = config | {"quantization_config": quantization | {"weight_block_size": [128, 128]}}
    folder.mkdir(exist_ok=True)
    paths = {"bf16": save(folder / "bf16", bf16, config, model)}
    for label, per_tensor in (("fp8", False), ("fp8 tensor", True)):
        tensors = dict(bf16)
        for name in linears:
            tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(bf16[name], per_tensor)
        paths[label] = save(folder / label.replace(" ", "-"), tensors, fp8_config, model)
    if not ints:
        return paths
    table = "model.embed_tokens.weight"  # tied to the head: int8 under both methods
    for method in ("int8", "int4"):
        tensors = {k: v.float() for k, v in bf16.items()}
        tensors |= {name: int_weights(bf16[name], method) for name in linears}
        tensors[table] = int_weights(bf16[table], "int8")
        paths[f"{method} weights"] = save(folder / method, tensors, config | {"dtype": "float32"})
    return paths


def step_bytes(model: nn.Module) -> tuple[int, int, int]:
    """(weights of the quantizable linear layers, their bytes with their scales,
    bytes of every other parameter) that one decode step of one token reads."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    linears = {n: m for n, m in model.named_modules() if n.endswith("_proj")}
    weights = sum(m.in_features * m.out_features for m in linears.values())
    linear_bytes = other = 0
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[0] in linears:
            linear_bytes += p.nbytes
        elif "embed_tokens" in name and uses[id(p)] == 1:
            other += p[0].nbytes  # an input table no layer shares: one row a token
        else:
            other += p.nbytes
    return weights, linear_bytes, other


def engine(path: Path, dtype: str, quantization: str | None = None) -> LLM:
    return LLM(path, dtype=dtype, quantization=quantization, seed=0)


def show_bytes(paths: dict[str, Path], results: dict) -> None:
    print("bytes a lone request's decode step reads: weights")
    print(f"{'format':<7}{'per weight':>11}{'linears':>10}{'the rest':>10}{'a step':>10}")
    for label, path, method in (
        ("bf16", paths["bf16"], None),
        ("fp8", paths["fp8"], None),
        ("int8", paths["bf16"], "int8"),
        ("int4", paths["bf16"], "int4"),
    ):
        model = engine(path, "bfloat16", method).llm_engine.executor.model_runner.model
        weights, linear, other = step_bytes(model)
        per_weight = round(linear / weights, BPW_PLACES)
        print(f"{label:<7}{per_weight:>11.{BPW_PLACES}f}{linear:>10,}{other:>10,}"
              f"{linear + other:>10,}")  # fmt: skip
        results |= {f"linear_weights_{label}": weights, f"per_weight_{label}": per_weight}
        results |= {f"linear_bytes_{label}": linear, f"other_bytes_{label}": other}
        results[f"step_bytes_{label}"] = linear + other
    for label in ("fp8", "int8", "int4"):
        share = results[f"step_bytes_{label}"] / results["step_bytes_bf16"]
        results[f"step_share_{label}"] = round(share, 3)
    tensors = load_file(paths["fp8"] / "model.safetensors")
    stored = sum(t.nbytes for n, t in tensors.items() if n.endswith("_scale_inv"))
    held = results["linear_bytes_fp8"] - results["linear_weights_fp8"]
    results |= {"fp8_scale_bytes_stored": stored, "fp8_scale_bytes_held": held}
    print(f"fp8 scales: {stored:,} bytes in the checkpoint, {held:,} held")


def rounded(x: float, places: int) -> float | int:
    return round(x, places) + 0.0 if places else int(round(x))  # + 0.0: no -0.0


def verdict(low: float, high: float) -> str:
    """Where a rounded gap interval lies."""
    return "lies above zero" if low > 0 else "lies below zero" if high < 0 else "holds zero"


FP8_ROWS = (("bf16", "bf16"), ("fp8", "fp8"), ("fp8 tensor", "fp8 tensor"))  # (row, checkpoint)
QUALITY = FP8_ROWS + (("int8", "int8 weights"), ("int4", "int4 weights"))


def show_quality(
    paths: dict[str, Path],
    results: dict,
    model: Path = MODEL,
    rows: tuple = QUALITY,
    prefix: str = "",
) -> list[list[int]]:
    """The quality table of ``rows``; results keyed by ``prefix`` and the row."""
    sizes = Sizes(heldout_tokens=HELDOUT, gen_tokens=GEN)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    scored = windows(tokenizer.encode(heldout_text()[0]).ids, sizes)
    prompts = [w[: sizes.prompt_len] for w in scored[: sizes.num_prompts]]
    draws = resamples(len(scored))
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    greedy = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    reference: list[list[int]] = []
    first = None
    print(f"\n{model.name}\nquality in float32, {len(scored)} windows of held-out text")
    print(f"{'format':<11}{'ppl':>6}{f'ppl {LEVEL:.0%}':>14}{'gap':>14}{'forced':>7}")
    for label, checkpoint in rows:
        llm = engine(paths[checkpoint], "float32")
        scores = window_scores(drive(llm, scored, score).outputs)
        first = first or scores
        reference = reference or [o.token_ids for o in drive(llm, prompts, greedy).outputs]
        ppl_interval, gap_interval = bootstrap(scores, first, draws)
        places = max(0, FIGURES - len(str(int(perplexity(scores)))))
        ppl = rounded(perplexity(scores), places)
        low, high = (rounded(x, places) for x in ppl_interval)
        gap_low, gap_high = (rounded(x, places + 1) for x in gap_interval)
        forced = round(forced_agreement(llm, prompts, reference), 3)
        gap = f"{gap_low:+.{places + 1}f}..{gap_high:+.{places + 1}f}"
        print(f"{label:<11}{ppl:>6}{f'{low}..{high}':>14}{gap:>14}{forced:>7.3f}")
        key = prefix + label.replace(" ", "_")
        results |= {f"ppl_{key}": ppl, f"ppl_low_{key}": low, f"ppl_high_{key}": high}
        results |= {f"gap_low_{key}": gap_low, f"gap_high_{key}": gap_high}
        results |= {f"gap_says_{key}": verdict(gap_low, gap_high), f"forced_{key}": forced}
    results |= {"windows": len(scored), "window_tokens": sizes.context, "gen_tokens": GEN}
    results |= {"prompts": len(prompts), "level": LEVEL}
    return prompts


def check_int_layers(paths: dict[str, Path], prompts: list[list[int]], results: dict) -> None:
    """The engine's int8 and int4 layers against the weights their rows ran."""
    greedy = SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    for method in ("int8", "int4"):
        runs = [
            drive(engine(path, "float32", q), prompts, greedy).outputs
            for path, q in ((paths["bf16"], method), (paths[f"{method} weights"], None))
        ]
        same = sum(a == b for x, y in zip(*runs) for a, b in zip(x.token_ids, y.token_ids))
        total = len(prompts) * CHECK_TOKENS
        print(f"{method} layers, greedy: {same} of {total} tokens match its weights")
        results |= {f"check_same_{method}": same, "check_tokens": total}


def main() -> dict:
    torch.set_num_threads(1)
    config = json.loads((MODEL / "config.json").read_text())
    shape = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    results: dict = {"block": BLOCK} | {key: config[key] for key in shape}
    with tempfile.TemporaryDirectory() as folder:
        paths = write_checkpoints(Path(folder))
        show_bytes(paths, results)
        prompts = show_quality(paths, results)
        check_int_layers(paths, prompts, results)
        moe = write_checkpoints(Path(folder) / "moe", MOE, ints=False)
        show_quality(moe, results, MOE, FP8_ROWS, "moe_")
    for key, block, tensor in (
        ("block_vs_tensor", "forced_fp8", "forced_fp8_tensor"),
        ("moe_block_vs_tensor", "forced_moe_fp8", "forced_moe_fp8_tensor"),
    ):
        better = results[block] - results[tensor]
        results[key] = "above" if better > 0 else "below" if better < 0 else "equal to"
    return results


if __name__ == "__main__":
    main()
