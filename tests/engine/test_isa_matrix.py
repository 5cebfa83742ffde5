"""The ISA-by-mode matrix: every model the engine serves, in each mode it offers,
run in a fresh process on this machine's own kernels and under capabilities that
another CPU would choose, with glibc's heap checks on.

A CI machine may be an Intel Xeon with AMX or an AMD EPYC (Zen 4: AVX-512
without AMX); a crash that one CPU's kernels hide is still a crash on the other.
So each cell runs three ways:

- native: whatever torch, oneDNN and Inductor pick on this CPU;
- avx2: ``ATEN_CPU_CAPABILITY=avx2`` and ``DNNL_MAX_CPU_ISA=AVX2``, ATen's,
  Inductor's and oneDNN's AVX2 code, as a CPU without AVX-512 runs;
- onednn-avx512-core: ``DNNL_MAX_CPU_ISA=AVX512_CORE``, oneDNN's AVX-512 kernels
  without AMX or bf16 instructions.

A cell passes when its process exits cleanly and, in float32, its greedy tokens
equal the model's eager float32 run. Its process runs with glibc's malloc
checks (``libc_malloc_debug.so`` and ``glibc.malloc.check=3``, where the C library
has them) and ``MALLOC_PERTURB_``, which fills freed and new memory, so that a
heap corruption that happens to survive still aborts. ``deepinfer serve`` starts,
answers and exits on SIGTERM under the same settings.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import ROOT
from tests.engine.conftest import build_tokenizer
from tests.engine.isa_child import MAX_TOKENS

SHIPPED = ROOT / "snippets" / "models"
CAPS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "onednn-avx512-core": {"DNNL_MAX_CPU_ISA": "AVX512_CORE"},
}
CHILD_TIMEOUT_S = 300
MALLOC_DEBUG_LIBS = [  # where Debian, Ubuntu and Fedora put it
    f"/usr/{lib}/libc_malloc_debug.so.0"
    for lib in ("lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu", "lib64", "lib")
]
# What glibc prints as it aborts on a corrupted heap: "free(): invalid pointer",
# "malloc_consolidate(): invalid chunk size", "corrupted size vs. prev_size", ...
GLIBC_HEAP_ERROR = re.compile(
    r"(malloc|free|realloc|malloc_consolidate)\(\): |corrupted |double free"
)


def heap_checks() -> dict[str, str]:
    """glibc's malloc checking (2.34 and later keep it in libc_malloc_debug.so) and
    perturbed memory; on a C library without the debug library, perturbation alone."""
    env = {"MALLOC_PERTURB_": "165"}
    found = [p for p in MALLOC_DEBUG_LIBS if Path(p).exists()]
    if found:
        env["LD_PRELOAD"] = found[0]
        env["GLIBC_TUNABLES"] = "glibc.malloc.check=3"
    return env


def child_env(cap: str) -> dict[str, str]:
    keep = {
        k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA")
    }
    return {
        **keep,
        **heap_checks(),
        **CAPS[cap],
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


@dataclass(frozen=True)
class Cell:
    model: str  # a key of the models fixture
    options: dict = field(default_factory=dict)  # EngineConfig's fields

    @property
    def exact(self) -> bool:
        """Float32 without a quantized cache: greedy tokens must equal eager fp32's."""
        return self.options.get("dtype") == "float32" and "kv_cache_dtype" not in self.options


FP32, BF16 = {"dtype": "float32"}, {"dtype": "bfloat16"}
EAGER, COMPILED = {"compile_decode": False}, {"compile_decode": True}
AUTOTUNE = {"compile_decode": True, "compile_mode": "max-autotune"}
TORCH = {"attention_backend": "torch"}
CELLS: dict[str, Cell] = {
    "tiny/eager-fp32": Cell("tiny", {**FP32, **EAGER}),
    "tiny/compiled-fp32": Cell("tiny", {**FP32, **COMPILED}),
    "tiny/autotune-fp32": Cell("tiny", {**FP32, **AUTOTUNE}),
    "tiny/eager-bf16": Cell("tiny", {**BF16, **EAGER}),
    "tiny/compiled-bf16": Cell("tiny", {**BF16, **COMPILED}),
    "tiny/eager-bf16-torch": Cell("tiny", {**BF16, **EAGER, **TORCH}),
    "tiny/kv-int8": Cell("tiny", {**FP32, **EAGER, "kv_cache_dtype": "int8"}),
    "tiny/kv-fp8-bf16": Cell("tiny", {**BF16, **EAGER, "kv_cache_dtype": "fp8_e4m3"}),
    "tiny/async-compiled-fp32": Cell("tiny", {**FP32, **COMPILED, "async_scheduling": True}),
    "moe/eager-fp32": Cell("moe", {**FP32, **EAGER}),
    "moe/compiled-fp32": Cell("moe", {**FP32, **COMPILED}),
    "moe/eager-bf16": Cell("moe", {**BF16, **EAGER}),
    "moe/async-fp32": Cell("moe", {**FP32, **EAGER, "async_scheduling": True}),
    "v32/eager-fp32": Cell("v32", {**FP32, **EAGER}),
    "v32/eager-bf16": Cell("v32", {**BF16, **EAGER}),
    "v32/async-fp32": Cell("v32", {**FP32, **EAGER, "async_scheduling": True}),
    "v4/eager-fp32": Cell("v4", {**FP32, **EAGER}),
    "v4/eager-bf16": Cell("v4", {**BF16, **EAGER}),
}
# Under the other capabilities: the cells whose kernels those settings change
# (Inductor's code, ATen's and oneDNN's matmuls, bf16 packing), one of each kind.
# tiny/compiled-fp32 under avx2 runs in test_a_graph_compiled_for_one_isa_... below.
CAPPED = {
    "avx2": ["tiny/eager-bf16", "tiny/compiled-bf16", "moe/compiled-fp32", "v32/eager-fp32"],
    "onednn-avx512-core": ["tiny/compiled-fp32", "tiny/eager-bf16", "v4/eager-fp32"],
}
MATRIX = [(name, "native") for name in CELLS if name != "tiny/compiled-fp32"]
MATRIX += [(name, cap) for cap, names in CAPPED.items() for name in names]


def v32_checkpoint(path: Path) -> Path:
    import transformers

    from tests.engine.test_dsa import dsa_config

    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(dsa_config(index_n_heads=4)).eval()
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


def v4_checkpoint(path: Path) -> Path:
    from tests.engine.test_deepseek_v4 import build

    build(path, "three-types")
    return path


BUILDERS = {"v32": v32_checkpoint, "v4": v4_checkpoint}
_built: dict[str, Path] = {}


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Callable[[str], Path]:
    """A model's folder by key; the random DeepSeek ones are built on first use."""

    def folder(key: str) -> Path:
        if key == "tiny":
            return SHIPPED / "deepinfer-tiny"
        if key == "moe":
            return SHIPPED / "deepinfer-tiny-moe"
        if key not in _built:
            _built[key] = BUILDERS[key](tmp_path_factory.mktemp(f"isa-{key}"))
        return _built[key]

    return folder


def run_cell(model: Path, options: dict, cap: str, cache: Path | None = None) -> list[int]:
    """The cell's greedy tokens; fails with the child's output if it did not exit
    cleanly. ``cache``: Inductor's cache folder (default: the machine's own)."""
    env = child_env(cap) | ({"TORCHINDUCTOR_CACHE_DIR": str(cache)} if cache else {})
    argv = [sys.executable, "-X", "faulthandler", "-m", "tests.engine.isa_child"]
    done = subprocess.run(
        [*argv, str(model), json.dumps(options)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=CHILD_TIMEOUT_S,
    )
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    assert done.returncode == 0, f"exit status {done.returncode} under {cap}:\n{tail}"
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(tokens) == MAX_TOKENS, tail
    return tokens


_eager: dict[str, list[int]] = {}


def eager_fp32(models: Callable[[str], Path], model: str) -> list[int]:
    """The model's eager float32 tokens, natively: what every exact cell must give."""
    if model not in _eager:
        _eager[model] = run_cell(models(model), {**FP32, **EAGER}, "native")
    return _eager[model]


@pytest.mark.parametrize(("name", "cap"), MATRIX, ids=[f"{n}-{c}" for n, c in MATRIX])
def test_cell_exits_cleanly_with_eager_tokens(models, name: str, cap: str) -> None:
    cell = CELLS[name]
    if cell.options == {**FP32, **EAGER} and cap == "native":
        eager_fp32(models, cell.model)  # the reference: it must run cleanly too
        return
    tokens = run_cell(models(cell.model), cell.options, cap)
    if cell.exact:
        assert tokens == eager_fp32(models, cell.model), f"{name} under {cap}"


def test_a_graph_compiled_for_one_isa_is_not_served_to_another(models, tmp_path) -> None:
    """One Inductor cache, three processes: AVX2, then this CPU's own ISA, then AVX2
    again. Inductor's cache keys leave out the vector ISA, so without the engine's
    tag (compiled_decode.isa_cache_tag) the second process built AVX2-stepped
    loops with 16-float stores and glibc aborted on the corrupted heap, and the
    third left half of each output unwritten (tokens 0, 0, 0 after the first)."""
    cell = CELLS["tiny/compiled-fp32"]
    want = eager_fp32(models, "tiny")
    for cap in ("avx2", "native", "avx2"):
        assert run_cell(models("tiny"), cell.options, cap, cache=tmp_path) == want, cap


# Each dtype once and each capability once: the compiled graphs under both ISAs are the
# cells' above (tiny/compiled-bf16 and tiny/compiled-fp32, native and avx2); what this
# adds is the server's life (start, answer, drain on SIGTERM) under the heap checks.
SERVE_MATRIX = [("bfloat16", "native"), ("float32", "avx2")]


@pytest.mark.parametrize(("dtype", "cap"), SERVE_MATRIX, ids=[f"{d}-{c}" for d, c in SERVE_MATRIX])
def test_serve_starts_answers_and_exits_on_sigterm(dtype: str, cap: str) -> None:
    """`deepinfer serve` with its default compiled decode: it starts, answers, and on
    SIGTERM drains and ends by that signal, as the README says, with no heap error."""
    from tests.server.conftest import ready, spawn, stop

    tiny = str(SHIPPED / "deepinfer-tiny")
    server = spawn(
        "serve", tiny, "--dtype", dtype, "--num-kv-blocks", "256", environ=child_env(cap)
    )
    try:
        ready(server)
        body = {
            "model": "deepinfer-tiny",
            "prompt": "Keys and values",
            "max_tokens": 4,
            "temperature": 0,
        }
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        server.proc.send_signal(signal.SIGTERM)
        status = server.proc.wait(timeout=60)
        text = server.log.read_text(errors="replace")
        assert status == -signal.SIGTERM, f"exit status {status} under {cap}:\n{text[-3000:]}"
        assert not GLIBC_HEAP_ERROR.search(text), text[-3000:]
    finally:
        stop(server)  # kills it if it still runs, and removes its log
