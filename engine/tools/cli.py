"""The `deepinfer` command line.

    deepinfer generate --model PATH "prompt"      stream a completion
    deepinfer serve PATH [--port 8000 ...]         an OpenAI-compatible HTTP server
    deepinfer router --worker URL --worker URL     one address in front of several servers
    deepinfer bench --model PATH ...               throughput and latency table
    deepinfer generate/bench ... --expert-parallel-size N [--eplb]
                                                   a MoE model's experts over N processes
    deepinfer bench --serve --model PATH ...       the same workload, over HTTP and offline
    deepinfer bench --model PATH --speculative-config JSON
                                                   speculative decoding against none
    deepinfer generate/serve/bench ... --kv-window SINKS,WINDOW
                                                   a sliding window with attention sinks
    deepinfer bench --kv-quality [--model PATH]    each KV cache's perplexity, agreement, bytes
    deepinfer bench --pd                           prefill/decode workers against colocated ones
    deepinfer edition check [PATH]                 does this checkout match the book?

Each subcommand imports what it needs when it runs, so `edition check` works
without torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig


def _edition_check(args: argparse.Namespace) -> int:
    from engine.tools.edition import check

    status, text = check(Path(args.path), Path(args.manifest) if args.manifest else None)
    print(text, file=sys.stderr if status == 2 else sys.stdout)
    return status


def _generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        compile_decode=args.compile_decode,
        compile_mode=args.compile_mode,
        speculative_config=args.speculative_config,
        kv_window=args.kv_window,
        **_expert_parallel(args),
    )
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    engine = llm.llm_engine
    engine.add_request("cli", args.prompt, params)
    print(args.prompt, end="", flush=True)
    shown = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.text[len(shown) :], end="", flush=True)  # stream only what is new
            shown = out.text
    print()
    return 0


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine `deepinfer serve` runs. With --batch-invariant, a request's greedy
    tokens do not depend on what else is in the batch; the compiled decode, whose
    kernels are not batch-invariant, stays off unless asked for."""
    from engine.config import EngineConfig

    compile_decode = args.compile_decode
    if args.batch_invariant and compile_decode is None:
        compile_decode = False
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        compile_decode=compile_decode,
        compile_mode=args.compile_mode,
        batch_invariant=args.batch_invariant,
        async_scheduling=args.async_scheduling,
        disable_any_whitespace=args.disable_any_whitespace,
        speculative_config=args.speculative_config,
        kv_window=args.kv_window,
        kv_store=args.kv_store,
        kv_store_max_bytes=args.kv_store_max_mib << 20,
        kv_store_load=args.kv_store_load,
        role=args.role,
    )


def _serve(args: argparse.Namespace) -> int:
    from engine.entrypoints.api_server import ServerConfig, run_server

    config = ServerConfig(
        serve_engine_config(args),
        served_model_names=args.served_model_name or [],
        api_key=args.api_key or os.environ.get("DEEPINFER_API_KEY") or None,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        head_timeout=args.head_timeout,
        body_timeout=args.body_timeout,
        engine_core=args.engine_core,
    )
    run_server(config, args.host, args.port, args.log_level)
    return 0


def _add_engine_core(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument(
        "--engine-core",
        choices=["process", "thread"],
        default="process",
        help=prefix + "run the engine's steps in a process of their own (default), or in a "
        "thread beside the HTTP side, which then shares one interpreter lock with them",
    )


def _add_read_timeouts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--head-timeout",
        type=float,
        default=60.0,
        help="seconds a client may take to send a request's line and headers",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request's body may pause before it gets 408",
    )


def _router(args: argparse.Namespace) -> int:
    if args.prefill or args.decode:
        return _pd_router(args)
    if not args.worker:
        raise SystemExit("deepinfer router: give --worker URLs, or --prefill and --decode URLs")
    from engine.entrypoints.router import RouterConfig, run_router

    config = RouterConfig(
        workers=args.worker,
        model=args.model,
        policy=args.policy,
        block_size=args.block_size,
        prefix_blocks=args.prefix_blocks,
        load_factor=args.load_factor,
        health_interval=args.health_interval,
        max_body_bytes=args.max_body_bytes,
        connect_timeout=args.connect_timeout,
        first_byte_timeout=args.first_byte_timeout,
        idle_timeout=args.idle_timeout,
        head_timeout=args.head_timeout,
        body_timeout=args.body_timeout,
    )
    run_router(config, args.host, args.port, args.log_level)
    return 0


def _pd_router(args: argparse.Namespace) -> int:
    """Prefill/decode disaggregation: --prefill and --decode workers (Chapter 8)."""
    if not (args.prefill and args.decode) or args.worker:
        raise SystemExit("deepinfer router: --prefill and --decode go together, without --worker")
    from engine.entrypoints.pd_router import PDRouterConfig, run_pd_router

    config = PDRouterConfig(
        prefill=args.prefill,
        decode=args.decode,
        model=args.model,
        block_size=args.block_size,
        prefix_blocks=args.prefix_blocks,
        load_factor=args.load_factor,
        health_interval=args.health_interval,
        connect_timeout=args.connect_timeout,
        idle_timeout=args.idle_timeout,
    )
    run_pd_router(config, args.host, args.port, args.log_level)
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.pd:  # deepinfer-tiny's own workers, on loopback
        from engine.tools.pd_bench import main as run_pd

        run_pd(["--repeats", str(args.repeats), "--seed", str(args.seed)])
        return 0
    if args.kv_quality:  # the shipped tiny models (or --model) and a random V3.2
        from engine.tools.kv_quality import run as run_quality

        print(run_quality([Path(args.model)] if args.model else None))
        return 0
    if args.model is None:
        print("deepinfer bench: --model is required", file=sys.stderr)
        return 2
    low, _, high = args.input_len.partition(":")
    if args.serve and args.kv_window is not None:
        print("deepinfer bench: --kv-window does not combine with --serve yet", file=sys.stderr)
        return 2
    if args.serve:
        from engine.tools.serve_bench import run as run_served

        concurrency = [int(c) for c in args.concurrency.split(",")]
        print(
            run_served(
                args.model,
                args.num_prompts,
                (int(low), int(high or low)),
                args.output_len,
                concurrency,
                seed=args.seed,
                device=args.device,
                threads=args.threads,
                engine_core=args.engine_core,
            )
        )
        return 0
    if args.speculative_config is not None:
        return _spec_bench(args, int(high or low))
    from engine.tools.bench import run

    print(
        run(
            args.model,
            args.num_prompts,
            (int(low), int(high or low)),
            args.output_len,
            args.compare_hf,
            seed=args.seed,
            kv_baselines=args.kv_baseline,
            repeats=args.repeats,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            compile_decode=args.compile_decode,
            compile_mode=args.compile_mode,
            max_num_seqs=max(args.num_prompts, 1),
            kv_window=args.kv_window,
            **_expert_parallel(args),
        )
    )
    return 0


def _spec_bench(args: argparse.Namespace, input_len: int) -> int:
    """Speculation against none (engine/tools/spec_bench.py), at --spec-batches."""
    from engine.tools.spec_bench import run

    batches = [int(b) for b in args.spec_batches.split(",")]
    print(
        run(
            args.model,
            args.speculative_config,
            batches,
            input_len,
            args.output_len,
            repeats=args.repeats,
            device=args.device,
            dtype=args.dtype,
            compile_decode=args.compile_decode,
            kv_window=args.kv_window,
        )
    )
    return 0


def kv_window(text: str) -> tuple[int, int]:
    """--kv-window SINKS,WINDOW as EngineConfig.kv_window takes it."""
    sinks, sep, window = text.partition(",")
    try:
        if not sep:
            raise ValueError
        return int(sinks), int(window)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected SINKS,WINDOW (two integers), got {text!r}"
        ) from None


def _add_kv_window(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-window",
        type=kv_window,
        default=None,
        metavar="SINKS,WINDOW",
        help="keep each request's first SINKS and last WINDOW tokens' cache blocks, and "
        "free the blocks between while it runs (default: keep every block)",
    )


def _add_speculative(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (prompt_lookup_min, prompt_lookup_max)',
    )


def _expert_parallel(args: argparse.Namespace) -> dict:
    """The engine keywords of --expert-parallel-size, --eplb and --num-redundant-experts."""
    return {
        "expert_parallel_size": args.expert_parallel_size,
        "enable_eplb": args.eplb,
        "num_redundant_experts": args.num_redundant_experts,
    }


def _add_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32 or bfloat16; default: bf16 where the CPU is fast at it",
    )


def _add_kv_cache_dtype(parser: argparse.ArgumentParser) -> None:
    from engine.config.kv_format import KV_CACHE_DTYPES

    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV cache's numbers: auto (the model's dtype), or one byte each "
        "with float32 scales (fp8_e4m3, int8)",
    )


def _add_quantization(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        default=None,
        help="weight-only quantization at load, on a CPU: int8 (a scale per output "
        "row) or int4 (a scale per 128 inputs); default: the checkpoint's own format",
    )


def _add_compile(parser: argparse.ArgumentParser, default: bool | None) -> None:
    from engine.config import COMPILE_MODES

    said = {None: "on where the model and device allow it", False: "off"}[default]
    parser.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="run decode steps through torch.compile: faster steps on a CPU, for "
        f"seconds of compiling at start-up (default: {said})",
    )
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default="default",
        help="max-autotune: the compiled step's matmuls may also be Inductor's own C++, "
        "faster for small models, at the cost of a second copy of the weights and a "
        "longer compile",
    )


def _add_expert_parallel(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="spread a MoE model's routed experts over N processes",
    )
    parser.add_argument(
        "--eplb",
        action="store_true",
        help="re-place the experts for their recorded load every 32 steps (EPLB)",
    )
    parser.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        metavar="R",
        help="with --eplb: R extra expert slots per layer, for copies of busy experts",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion of one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None)
    _add_dtype(gen)
    _add_kv_cache_dtype(gen)
    _add_quantization(gen)
    _add_compile(gen, default=False)
    gen.add_argument("--max-model-len", type=int, default=None)
    _add_speculative(gen)
    _add_kv_window(gen)
    _add_expert_parallel(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    serve.add_argument("model", help="a Hugging Face checkpoint folder")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/ "
        "(default: $DEEPINFER_API_KEY; none: open)",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        help="the name clients ask for (repeatable; default: the folder's name)",
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests without a first token beyond which new ones get 503",
    )
    serve.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    _add_read_timeouts(serve)
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds that requests in flight may go on; "
        "those still running then end with a 503 or an error event",
    )
    serve.add_argument("--device", default=None)
    _add_dtype(serve)
    _add_kv_cache_dtype(serve)
    _add_quantization(serve)
    _add_compile(serve, default=None)  # a server runs long enough to repay it
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--num-kv-blocks", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-num-batched-tokens", type=int, default=8192)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's greedy tokens do not depend on the rest of the batch (slower)",
    )
    serve.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule each step while the one before it runs (not with "
        "--speculative-config or --kv-store)",
    )
    serve.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="JSON outputs (response_format, json schemas) get no whitespace outside strings",
    )
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--kv-store",
        default=None,
        help="a KV cache store shared with other workers: a directory, or redis://HOST:PORT/DB",
    )
    serve.add_argument(
        "--kv-store-max-mib", type=int, default=1024, help="a directory store's size bound"
    )
    serve.add_argument(
        "--kv-store-load",
        choices=["measured", "always"],
        default="measured",
        help="load a stored prefix when measured cheaper than recomputing it, or always",
    )
    serve.add_argument(
        "--role",
        choices=["prefill", "decode", "both"],
        default="both",
        help="prefill/decode disaggregation: what this worker does (needs --kv-store)",
    )
    _add_speculative(serve)
    _add_kv_window(serve)
    _add_engine_core(serve)
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)

    router = sub.add_parser("router", help="route OpenAI requests to several servers")
    router.add_argument("--worker", action="append", default=[], help="a server's URL")
    router.add_argument(
        "--prefill", action="append", default=[], help="a prefill worker's URL (PD mode)"
    )
    router.add_argument(
        "--decode", action="append", default=[], help="a decode worker's URL (PD mode)"
    )
    router.add_argument(
        "--model",
        default=None,
        help="the workers' checkpoint folder, for its tokenizer and "
        "chat template (prefix-affinity routing hashes the prompt's tokens)",
    )
    router.add_argument("--policy", choices=["prefix", "round-robin"], default="prefix")
    router.add_argument("--block-size", type=int, default=16, help="the workers' block size")
    router.add_argument(
        "--prefix-blocks",
        type=int,
        default=4,
        help="how many leading blocks of the prompt choose its worker",
    )
    router.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        help="a worker takes at most this times the mean load in flight",
    )
    router.add_argument("--health-interval", type=float, default=2.0, help="seconds")
    _add_read_timeouts(router)
    router.add_argument("--connect-timeout", type=float, default=2.0, help="seconds")
    router.add_argument(
        "--first-byte-timeout",
        type=float,
        default=600.0,
        help="seconds a worker may take to begin its reply before the request goes "
        "to another (a non-streamed reply begins when it is whole)",
    )
    router.add_argument(
        "--idle-timeout",
        type=float,
        default=120.0,
        help="seconds a reply may pause; a stream then ends with an error event",
    )
    router.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8080)
    router.add_argument("--log-level", default="info")
    router.set_defaults(func=_router)

    bench = sub.add_parser("bench", help="output tokens/s, TTFT and inter-token latency")
    bench.add_argument("--model", default=None, help="required, except with --kv-quality")
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument(
        "--input-len", default="64:256", help="A (every prompt A tokens) or A:B (uniform in A..B)"
    )
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run transformers' batched generate in the same run",
    )
    bench.add_argument(
        "--serve",
        action="store_true",
        help="the same workload through `deepinfer serve` and LLM.generate, as ratios",
    )
    bench.add_argument(
        "--concurrency", default="1,16,64", help="with --serve: clients at once, A,B,..."
    )
    bench.add_argument(
        "--threads", type=int, default=1, help="with --serve: torch threads on each side"
    )
    _add_engine_core(bench, "with --serve: the server's engine core: ")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--repeats", type=int, default=3, help="timed runs per side")
    bench.add_argument("--device", default=None)
    bench.add_argument("--dtype", default=None, help="both sides' dtype; default: the engine's")
    _add_kv_cache_dtype(bench)
    _add_quantization(bench)
    _add_compile(bench, default=False)
    bench.add_argument(
        "--kv-baseline",
        action="append",
        default=[],
        metavar="PATH",
        help="also load this model and compare its KV bytes per token (repeatable)",
    )
    _add_expert_parallel(bench)
    _add_speculative(bench)
    _add_kv_window(bench)
    bench.add_argument(
        "--spec-batches",
        default="1,32",
        help="with --speculative-config: the batch sizes to compare at, A,B,... "
        "(prompts of the --input-len upper bound, from the book and random)",
    )
    bench.add_argument(
        "--kv-quality",
        action="store_true",
        help="held-out perplexity, greedy agreement and KV bytes per token for each "
        "cache (exact, fp8_e4m3, int8, a window; DSA on a random V3.2), float32",
    )
    bench.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation on deepinfer-tiny: interference against two "
        "colocated workers, per-request transfer, store MB/s, and the load/compute break-even",
    )
    bench.set_defaults(func=_bench)

    edition = sub.add_parser("edition", help="compare a checkout with the book's edition")
    edition_sub = edition.add_subparsers(dest="edition_command", required=True)
    check = edition_sub.add_parser(
        "check",
        help="list, chapter by chapter, the excerpts that changed, moved or vanished",
    )
    check.add_argument("path", nargs="?", default=".", help="the checkout (default: .)")
    check.add_argument(
        "--manifest",
        help="the edition.json to compare with (default: PATH/docs/edition.json); "
        "use the one a published site links from its footer",
    )
    check.set_defaults(func=_edition_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # bad input: say what, without a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
