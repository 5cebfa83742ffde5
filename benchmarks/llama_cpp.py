"""DeepInfer against llama.cpp on the same CPU, model and workload: one table of ratios.

    .venv/bin/python benchmarks/llama_cpp.py [--model DIR] [--batches 1,8,64,256]
        [--input-len 143] [--output-len 64] [--threads N] [--qwen3-0.6b]

What it does, each step cached under benchmarks/.cache/:

1. builds llama.cpp's `llama-batched-bench` from the vendored source in the
   `llama-cpp-python` sdist (a pinned version, fetched with pip; cmake, Release);
2. converts the model to a GGUF file (f16, llama.cpp's usual default) with the
   converter that ships in that source. deepinfer-tiny's byte-level BPE splits
   text with GPT-2's regex, but the converter knows pre-tokenizers only by the
   hash of a fixed test string's tokens, and does not know this tokenizer's: the
   script tells it "gpt-2" for a tokenizer it does not recognise, from outside,
   without editing the vendored file (``--pre-tokenizer``);
3. for each batch size, runs `llama-batched-bench` (B sequences, every prompt
   of the input length, then the output length generated) and `deepinfer bench`
   (B random prompts of the same length, the same output length), each in its
   own process, and reads each side's peak RSS from the kernel (wait4);
4. prints one table: output tokens/s per side and their ratio, and peak RSS.

llama-batched-bench's prompts are one token repeated and no prefix is shared
between its sequences; DeepInfer's are random tokens, so its prefix cache finds
nothing either. Output tokens/s is B x output length over the whole run's time,
prefill included, on both sides. Not part of `make test`: it takes minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(__file__).resolve().parent / ".cache"
LLAMA_CPP_PYTHON = "0.3.16"  # its vendor/llama.cpp is the llama.cpp measured
TINY = ROOT / "snippets/models/deepinfer-tiny"


def llama_source() -> Path:
    """The llama-cpp-python sdist, fetched with pip and unpacked once."""
    src = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not src.is_dir():
        CACHE.mkdir(exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        subprocess.run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", CACHE], check=True)
        with tarfile.open(CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(CACHE, filter="data")
    return src / "vendor/llama.cpp"


def build_batched_bench(src: Path) -> Path:
    """cmake's Release build of llama-batched-bench alone (CPU backend, no curl)."""
    build = CACHE / f"build-{LLAMA_CPP_PYTHON}"
    exe = build / "bin/llama-batched-bench"
    if not exe.is_file():
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
        flags += ["-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
        subprocess.run(["cmake", "-S", src, "-B", build, *flags], check=True)
        jobs = str(os.cpu_count() or 1)
        cmd = ["cmake", "--build", build, "--target", "llama-batched-bench", "-j", jobs]
        subprocess.run(cmd, check=True)
    return exe


CONVERT = """
import importlib.util, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, src + "/gguf-py")
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", src + "/convert_hf_to_gguf.py")
convert = importlib.util.module_from_spec(spec)
sys.modules["convert_hf_to_gguf"] = convert
spec.loader.exec_module(convert)
known = convert.TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:  # an unknown hash: the name we were given
        print(f"pre-tokenizer not recognised by hash: using {pre!r}", file=sys.stderr)
        return pre

convert.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
convert.main()
"""


# What the converter imports that the engine's environment lacks (it imports
# mistral_common unconditionally), pinned, installed beside it rather than into .venv;
# their own dependencies (pydantic, numpy, regex, ...) come from .venv.
CONVERTER_DEPS = [
    "mistral-common==1.13.1",
    "pydantic-extra-types==2.11.1",
    "pycountry==26.2.16",
    "tiktoken==0.14.0",
    "sentencepiece==0.2.1",
]


def converter_deps() -> Path:
    target = CACHE / "convert-deps"
    if not (target / "mistral_common").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target]
        subprocess.run([*pip, *CONVERTER_DEPS], check=True)
    return target


def convert_to_gguf(src: Path, model: Path, pre_tokenizer: str) -> Path:
    out = CACHE / f"{model.name}-f16.gguf"
    if not out.is_file():
        args = [str(model), "--outtype", "f16", "--outfile", str(out)]
        cmd = [sys.executable, "-c", CONVERT, str(src), pre_tokenizer, *args]
        env = dict(os.environ, PYTHONPATH=str(converter_deps()))
        subprocess.run(cmd, check=True, env=env)
    return out


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[str, float]:
    """Run ``cmd``; its output, and its peak RSS in MB as the kernel counted it."""
    with tempfile.TemporaryFile("w+") as log:  # a pipe could fill up and stall it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)  # reap it ourselves, to get its rusage
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        out = log.read()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}):\n{out[-3000:]}")
    return out, usage.ru_maxrss / 1024  # Linux counts it in kilobytes


def llama_side(exe: Path, gguf: Path, batch: int, input_len: int, output_len: int, threads: int):
    ctx = batch * (input_len + output_len)
    cmd = [str(exe), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512"]
    cmd += ["-npp", str(input_len), "-ntg", str(output_len), "-npl", str(batch)]
    cmd += ["-t", str(threads), "-tb", str(threads)]
    out, rss = run_measured(cmd)
    row = next(ln for ln in out.splitlines() if re.match(rf"\|\s*{input_len} \|", ln))
    cells = [c.strip() for c in row.strip("|").split("|")]
    seconds = float(cells[8])  # T s: prefill and generation
    return batch * output_len / seconds, rss


def deepinfer_side(model: Path, batch, input_len, output_len, threads, repeats, dtype):
    cmd = [sys.executable, "-m", "engine.tools.cli", "bench", "--model", str(model)]
    cmd += ["--num-prompts", str(batch), "--input-len", str(input_len)]
    cmd += ["--output-len", str(output_len), "--repeats", str(repeats)]
    if dtype:
        cmd += ["--dtype", dtype]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out, _ = run_measured(cmd, env)
    rate = float(_row(out, "output tokens/s")[0])  # the best repeat
    rss = float(_row(out, "peak RSS (MB)")[0])  # the engine's own process
    dt = re.search(r"cpu, (\w+), ", out)[1]
    return rate, rss, dt


def _row(out: str, label: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if ln.startswith(label))
    return line[len(label) :].split()


def make_qwen3_06b(tokenizer_from: Path) -> Path:
    """A Qwen3-0.6B-shaped model with random bf16 weights, built offline from its
    config, with deepinfer-tiny's tokenizer files (the converter pads the vocab)."""
    folder = CACHE / "qwen3-0.6b-random"
    if not (folder / "config.json").is_file():
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from engine.tools.kernel_bench import QWEN3_0_6B

        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B)).to(torch.bfloat16).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_from / name).is_file():
                shutil.copy(tokenizer_from / name, folder / name)
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=TINY)
    p.add_argument("--qwen3-0.6b", dest="qwen3", action="store_true", help="instead of --model")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--input-len", type=int, default=143)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=2, help="DeepInfer's timed runs (best shown)")
    p.add_argument("--dtype", default=None, help="DeepInfer's; default: the engine's CPU default")
    p.add_argument("--pre-tokenizer", default="gpt-2", help="for a tokenizer the converter lacks")
    args = p.parse_args()
    model = make_qwen3_06b(TINY) if args.qwen3 else args.model.resolve()
    src = llama_source()
    exe = build_batched_bench(src)
    gguf = convert_to_gguf(src, model, args.pre_tokenizer)
    print(f"{model.name}, prompts of {args.input_len} tokens, {args.output_len} output tokens, ")
    print(f"{args.threads} threads; llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON}, f16 GGUF")
    head = f"{'batch':>5} {'llama.cpp tok/s':>16} {'DeepInfer tok/s':>16} {'ratio':>7}"
    print(head + f" {'RSS llama.cpp MB':>17} {'RSS DeepInfer MB':>17} {'load':>5}")
    for batch in [int(b) for b in args.batches.split(",")]:
        theirs, their_rss = llama_side(
            exe, gguf, batch, args.input_len, args.output_len, args.threads
        )
        ours, our_rss, dtype = deepinfer_side(
            model, batch, args.input_len, args.output_len, args.threads, args.repeats, args.dtype
        )
        load = os.getloadavg()[0]
        print(
            f"{batch:5d} {theirs:16.1f} {ours:16.1f} {ours / theirs:6.2f}x"
            f" {their_rss:17.0f} {our_rss:17.0f} {load:5.2f}",
            flush=True,
        )
    print(f"DeepInfer dtype: {dtype}; ratio: DeepInfer / llama.cpp output tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
