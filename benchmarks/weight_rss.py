"""Peak RSS at load, by weight format, against the checkpoint's size.

    python benchmarks/weight_rss.py                  # a Qwen3 shape, 8 layers of 1024
    python benchmarks/weight_rss.py --layers 28

Builds (once, under benchmarks/.work) a random Qwen3-shaped checkpoint in bfloat16
and its DeepSeek-layout FP8 copy (tests/engine/fp8_checkpoints.py's quantization),
then loads each in a fresh process with a small KV cache and prints the process's
peak RSS (VmHWM: ru_maxrss would count the parent's pages from before exec), the same for a process that only imports the
engine, and the checkpoint's bytes: for bf16, for FP8 as stored, and for bf16
quantized at load to int8 and int4. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / ".work"

CHILD = """
import sys, torch
from engine import LLM
torch.set_num_threads(1)
if sys.argv[1] != "-":
    kwargs = {"quantization": sys.argv[2]} if sys.argv[2] != "-" else {}
    LLM(sys.argv[1], dtype="bfloat16", num_kv_blocks=16, **kwargs)
status = open("/proc/self/status").read().split("VmHWM:")[1]
print(int(status.split()[0]) // 1024)
"""


def build(layers: int) -> tuple[Path, Path]:
    """(bf16 checkpoint, FP8 checkpoint) of a Qwen3 shape with ``layers`` layers."""
    import torch
    import transformers

    from tests.engine.conftest import build_tokenizer
    from tests.engine.fp8_checkpoints import quantize_checkpoint

    plain, fp8 = WORK / f"qwen3-{layers}-bf16", WORK / f"qwen3-{layers}-fp8"
    if (fp8 / "config.json").is_file():
        return plain, fp8
    config = transformers.Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(fp8)
    build_tokenizer(fp8)
    quantize_checkpoint(fp8, WORK / "dequantized")  # float32 copy: the oracle's, unused here
    model.save_pretrained(plain)
    build_tokenizer(plain)
    return plain, fp8


def peak_mb(path: str, quantization: str = "-") -> int:
    cmd = [sys.executable, "-c", CHILD, path, quantization]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return int(out.stdout.split()[-1])


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    plain, fp8 = build(args.layers)
    rows = {
        "engine imported, nothing loaded": (peak_mb("-"), 0.0),
        "bf16 checkpoint": (peak_mb(str(plain)), size_mb(plain)),
        "bf16 quantized at load: int8": (peak_mb(str(plain), "int8"), size_mb(plain)),
        "bf16 quantized at load: int4": (peak_mb(str(plain), "int4"), size_mb(plain)),
        "FP8 block-scaled checkpoint": (peak_mb(str(fp8)), size_mb(fp8)),
    }
    print(json.dumps({"layers": args.layers}))
    print(f"{'load':>34} {'peak RSS MB':>12} {'checkpoint MB':>14}")
    for name, (rss, size) in rows.items():
        print(f"{name:>34} {rss:12d} {size:14.0f}")


if __name__ == "__main__":
    main()
