"""DeepInfer against llama.cpp on this CPU: one workload, both engines, one table.

    python benchmarks/llama_cpp.py                          # deepinfer-tiny, batches 1 8 64 256
    python benchmarks/llama_cpp.py --model qwen3-0.6b-shape --batches 1,8,64
    python benchmarks/llama_cpp.py --dtypes bfloat16,float32 --input-len 143 --output-len 64
    python benchmarks/llama_cpp.py --dtypes bfloat16 --compile-decode --transformers
    python benchmarks/llama_cpp.py --dtypes bfloat16 --compile-decode --autotune
    python benchmarks/llama_cpp.py --ggufs f16,bf16,q8_0,q4_0 --quantizations int8,int4

What it does, caching each step under --work (default benchmarks/.work):

1. Downloads the llama-cpp-python source distribution (a pinned version) with pip and
   builds the llama.cpp it vendors with cmake: only the `llama-batched-bench` and
   `llama-quantize` tools, for this CPU (GGML_NATIVE).
2. Converts the model to GGUF with the converter llama.cpp ships, at each of --ggufs:
   f16 (llama.cpp's default), bf16 and q8_0 by the converter, q4_0 by llama-quantize
   from the f16 file. deepinfer-tiny's tokenizer is byte-level BPE with GPT-2's pre-tokenizer
   regex, which the converter cannot identify by its hash, and it has no tokenizer.model:
   the converter is told both from outside (see `convert`), with no vendored file edited.
   `qwen3-0.6b-shape` is Qwen3-0.6B's config with random weights, built offline.
3. For every batch size B: B prompts of --input-len tokens, --output-len new tokens each,
   greedy, no early stop. llama.cpp runs `llama-batched-bench` (one process per B);
   DeepInfer runs `LLM.generate` (one process per B and dtype, warmed up first on an
   unrelated batch; with --compile-decode, also with compile_decode=True, whose compile
   happens at start-up, outside the timed run; with --autotune, also compiled under
   compile_mode="max-autotune"; with --quantizations, also each weight-only method,
   quantization="int8" or "int4", in the first dtype, and compiled too with
   --compile-decode); with --transformers, transformers'
   `generate` runs too, warmed up alike. Each side's time covers prefill and decode; its
   peak RSS is the process's own, from the kernel (wait4).

It prints one table: output tokens/s of each side, each DeepInfer column's ratio to
the first GGUF, and peak RSS. One run,
on whatever else the machine is doing: read the ratios, not the absolute numbers, and
run it on an idle machine. Not part of `make test` (it downloads and builds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"  # pinned: its vendored llama.cpp is what gets built
TINY = ROOT / "snippets" / "models" / "deepinfer-tiny"
# Qwen3-0.6B's published config (Qwen/Qwen3-0.6B, config.json), weights random.
QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


# ---------------------------------------------------------------- llama.cpp


def llama_source(work: Path) -> Path:
    """The llama.cpp tree vendored in the pinned llama-cpp-python sdist."""
    tree = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not tree.is_dir():
        sdist = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not sdist.is_file():
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            run([*pip, "-d", str(work), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"])
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    return tree / "vendor" / "llama.cpp"


TOOLS = ("llama-batched-bench", "llama-quantize")


def build_tools(llama: Path, jobs: int) -> Path:
    """The folder of the built TOOLS."""
    bin_dir = llama / "build" / "bin"
    if not all((bin_dir / tool).is_file() for tool in TOOLS):
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]
        flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
        run(["cmake", "-S", str(llama), "-B", str(llama / "build"), *flags])
        run(["cmake", "--build", str(llama / "build"), "--target", *TOOLS] + ["-j", str(jobs)])
    return bin_dir


CONVERT = """
import sys
from pathlib import Path
llama = Path(sys.argv[1])
sys.path[:0] = [str(llama), str(llama / "gguf-py")]
import conversion.base as base

# GPT-2's pre-tokenizer regex, which the converter knows only by the hashes of
# models it has seen.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# Without sentencepiece installed the converter fails on import before it finds
# there is no tokenizer.model; say what it would have found.
sentencepiece = base.TextModel._set_vocab_sentencepiece

def byte_level_bpe(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model: byte-level BPE in tokenizer.json")
    return sentencepiece(self, *args, **kwargs)

base.TextModel._set_vocab_sentencepiece = byte_level_bpe
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def convert(llama: Path, model: Path, out: Path, outtype: str = "f16") -> Path:
    if not out.is_file():
        run(
            [sys.executable, "-c", CONVERT, str(llama), str(model)]
            + ["--outfile", str(out), "--outtype", outtype]
        )
    return out


def gguf_file(llama: Path, bin_dir: Path, model: Path, work: Path, kind: str) -> Path:
    """The model's GGUF of one kind: f16, bf16 and q8_0 from the converter, q4_0 by
    llama-quantize from the f16 file (the converter writes no Q4_0)."""
    out = work / f"{model.name}-{kind}.gguf"
    if kind != "q4_0":
        return convert(llama, model, out, kind)
    if not out.is_file():
        f16 = gguf_file(llama, bin_dir, model, work, "f16")
        env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
        subprocess.run(
            [str(bin_dir / "llama-quantize"), str(f16), str(out), "Q4_0"], check=True, env=env
        )
    return out


# ---------------------------------------------------------------- models


BUILD_QWEN3_SHAPE = """
import json, sys
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
model = Qwen3ForCausalLM(Qwen3Config(**json.loads(sys.argv[2]))).to(torch.bfloat16)
model.save_pretrained(sys.argv[1])
"""


def qwen3_shape(work: Path) -> Path:
    """Qwen3-0.6B's shapes with random weights (bf16), and deepinfer-tiny's tokenizer:
    speed depends on the shapes, not on what the weights learned. Built in a process
    of its own: a child forked from a process that held the model would inherit its
    peak RSS (Linux carries it over exec), and every peak measured here would be wrong."""
    out = work / "qwen3-0.6b-shape"
    if not (out / "model.safetensors").is_file():
        run([sys.executable, "-c", BUILD_QWEN3_SHAPE, str(out), json.dumps(QWEN3_06B)])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY / name, out / name)
    return out


# ---------------------------------------------------------------- measuring


@dataclass
class Run:
    seconds: float  # prefill and decode of the whole batch
    output_tokens: int
    peak_rss_mb: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd[:4]), "..." if len(cmd) > 4 else "", flush=True)
    subprocess.run(cmd, check=True)


def measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, float]:
    """Run cmd; its stdout and the peak RSS (MB) the kernel recorded for it. Its
    stdout goes to a file: into a pipe, llama-batched-bench's logger thread left
    its table unprinted in two runs of three on this machine, into a file in none."""
    with tempfile.TemporaryFile() as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        sink.seek(0)
        out = sink.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{out[-2000:]}")
    return out, usage.ru_maxrss / 1024  # KiB on Linux


def llama_cpp_run(binary: Path, gguf: Path, batch: int, args: argparse.Namespace) -> Run:
    """llama-batched-bench with B parallel sequences; T (its last timing) covers
    the prompts and the generated tokens."""
    ctx = batch * (args.input_len + args.output_len)
    cmd = [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512"]
    cmd += ["-npp", str(args.input_len), "-ntg", str(args.output_len), "-npl", str(batch)]
    cmd += ["-t", str(args.threads), "--output-format", "jsonl", "--fit", "off"]
    # Its shared libraries sit beside it; the library path keeps the build movable.
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    # Its logger prints from a thread of its own, which the process may leave
    # unflushed at exit (llama.cpp issue 22142): a run that printed nothing runs again.
    for _ in range(5):
        out, rss = measured(cmd, env)
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        found = [r for r in rows if r.get("pl") == batch]
        if found:
            return Run(found[0]["t"], batch * args.output_len, rss)
        if out.strip():  # it skips, silently, a batch whose tokens exceed its context
            break
    raise RuntimeError(f"llama-batched-bench measured no batch of {batch}:\n{out[-2000:]}")


ENGINE = """
import json, sys, time
import torch
from engine import LLM, SamplingParams
from engine.tools.bench import random_prompts
model, dtype, batch, input_len, output_len, threads, compiled, quant = sys.argv[1:9]
batch, input_len, output_len = int(batch), int(input_len), int(output_len)
torch.set_num_threads(int(threads))
# The blocks the batch needs and no more, as llama.cpp gets -c batch * (in + out).
blocks = batch * -(-(input_len + output_len) // 16)
llm = LLM(
    model, dtype=dtype, max_num_seqs=batch, block_size=16, num_kv_blocks=blocks,
    compile_decode=compiled != "0",
    compile_mode="max-autotune" if compiled == "autotune" else "default",
    quantization=None if quant == "-" else quant,
)
vocab = llm.llm_engine.config.hf_config.vocab_size
def prompts(n, seed):
    return random_prompts(n, input_len, input_len, vocab, seed)
params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
llm.generate(prompts(min(batch, 8), seed=1), params, use_tqdm=False)  # warm-up, unrelated
start = time.perf_counter()
outs = llm.generate(prompts(batch, seed=2), params, use_tqdm=False)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tokens": sum(len(o.token_ids) for o in outs)}))
"""


TRANSFORMERS = """
import json, sys
import torch
from engine.tools.bench import load_transformers, random_prompts, run_transformers
model, dtype, batch, input_len, output_len, threads = sys.argv[1:7]
batch, input_len, output_len = int(batch), int(input_len), int(output_len)
torch.set_num_threads(int(threads))
dtype = getattr(torch, dtype)
hf = load_transformers(model, "cpu", dtype)
vocab = hf.config.vocab_size
def prompts(n, seed):
    return random_prompts(n, input_len, input_len, vocab, seed)
run_transformers(model, prompts(min(batch, 8), seed=1), 4, "cpu", dtype, hf)  # warm-up
r = run_transformers(model, prompts(batch, seed=2), output_len, "cpu", dtype, hf)
print(json.dumps({"seconds": r.seconds, "tokens": r.output_tokens}))
"""


def python_run(script: str, model: Path, dtype: str, batch: int, args, *extra: str) -> Run:
    """The engine or transformers, in a process of its own, on the same workload."""
    cmd = [sys.executable, "-c", script, str(model), dtype, str(batch)]
    cmd += [str(args.input_len), str(args.output_len), str(args.threads), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out, rss = measured(cmd, env)
    row = json.loads(out.strip().splitlines()[-1])
    return Run(row["seconds"], row["tokens"], rss)


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default="deepinfer-tiny",
        help="deepinfer-tiny, qwen3-0.6b-shape, or a checkpoint directory",
    )
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--input-len", type=int, default=143)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument(
        "--ggufs",
        default="f16",
        help="llama.cpp's files: any of f16, bf16, q8_0, q4_0; ratios are to the first",
    )
    parser.add_argument(
        "--quantizations",
        default="",
        help="also DeepInfer with these weight-only methods (int8, int4), in the first dtype",
    )
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="also run each dtype with compile_decode=True (its compile is in the warm-up)",
    )
    parser.add_argument(
        "--autotune",
        action="store_true",
        help="also run each dtype with compile_decode=True, compile_mode='max-autotune'",
    )
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="also run transformers' generate, in the first dtype",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    llama = llama_source(args.work)
    bin_dir = build_tools(llama, args.threads)
    binary = bin_dir / "llama-batched-bench"
    if args.model == "deepinfer-tiny":
        model = TINY
    elif args.model == "qwen3-0.6b-shape":
        model = qwen3_shape(args.work)
    else:
        model = Path(args.model)
    ggufs = {
        kind: gguf_file(llama, bin_dir, model, args.work, kind) for kind in args.ggufs.split(",")
    }
    dtypes = args.dtypes.split(",")
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
    # (column label, how to run it); DeepInfer's columns are named by dtype alone
    sides = [(short.get(d, d), (ENGINE, d, "0", "-")) for d in dtypes]
    if args.compile_decode:
        sides += [(f"{short.get(d, d)}+compile", (ENGINE, d, "1", "-")) for d in dtypes]
    if args.autotune:
        sides += [(f"{short.get(d, d)}+autotune", (ENGINE, d, "autotune", "-")) for d in dtypes]
    for quant in filter(None, args.quantizations.split(",")):
        first = short.get(dtypes[0], dtypes[0])
        sides.append((f"{first} {quant}", (ENGINE, dtypes[0], "0", quant)))
        if args.compile_decode:
            sides.append((f"{first} {quant}+compile", (ENGINE, dtypes[0], "1", quant)))
    if args.transformers:
        sides.append((f"HF {short.get(dtypes[0], dtypes[0])}", (TRANSFORMERS, dtypes[0])))

    print(
        f"\n{model.name}: prompts of {args.input_len} tokens, {args.output_len} new tokens "
        f"each, greedy; {args.threads} threads; load average "
        f"{os.getloadavg()[0]:.1f} at start"
    )
    print(
        "output tokens/s of llama.cpp (by GGUF) and of DeepInfer (by dtype, +compile:"
        " compile_decode=True, +autotune: also compile_mode='max-autotune', int8/int4: weight-only"
        " quantization) and transformers (HF), each DeepInfer side's ratio to the first GGUF's,"
        " and each process's peak RSS (MB)"
    )
    header = f"{'batch':>5}" + "".join(f" {'llama ' + kind:>14}" for kind in ggufs)
    for label, _ in sides:
        header += f" {label:>16} {'ratio':>6}"
    header += "".join(f" {'RSS ' + kind:>10}" for kind in ggufs)
    header += "".join(f" {'RSS ' + label:>17}" for label, _ in sides)
    print(header)
    for batch in [int(b) for b in args.batches.split(",")]:
        refs = [llama_cpp_run(binary, gguf, batch, args) for gguf in ggufs.values()]
        ours = [
            python_run(script, model, how[0], batch, args, *how[1:]) for _, (script, *how) in sides
        ]
        line = f"{batch:>5}" + "".join(f" {r.tokens_per_s:>10,.0f} t/s" for r in refs)
        for r in ours:
            line += f" {r.tokens_per_s:>12,.0f} t/s {r.tokens_per_s / refs[0].tokens_per_s:>5.2f}x"
        line += "".join(f" {r.peak_rss_mb:>10,.0f}" for r in refs)
        line += "".join(f" {r.peak_rss_mb:>17,.0f}" for r in ours)
        print(line, flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end; {time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
