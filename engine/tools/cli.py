"""The `deepinfer` command line.

    deepinfer generate --model PATH "prompt"      stream a completion
    deepinfer bench --model PATH ...               throughput and latency table
    deepinfer edition check [PATH]                 does this checkout match the book?

Each subcommand imports what it needs when it runs, so `edition check` works
without torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _edition_check(args: argparse.Namespace) -> int:
    from engine.tools.edition import check

    status, text = check(Path(args.path), Path(args.manifest) if args.manifest else None)
    print(text, file=sys.stderr if status == 2 else sys.stdout)
    return status


def _generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len)
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


def _bench(args: argparse.Namespace) -> int:
    from engine.tools.bench import run

    low, _, high = args.input_len.partition(":")
    print(
        run(
            args.model,
            args.num_prompts,
            (int(low), int(high or low)),
            args.output_len,
            args.compare_hf,
            seed=args.seed,
            kv_baselines=args.kv_baseline,
            device=args.device,
            max_num_seqs=max(args.num_prompts, 1),
        )
    )
    return 0


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
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="output tokens/s, TTFT and inter-token latency")
    bench.add_argument("--model", required=True)
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument("--input-len", default="64:256", help="A:B, uniform prompt lengths")
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run transformers' batched generate in the same run",
    )
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--device", default=None)
    bench.add_argument(
        "--kv-baseline",
        action="append",
        default=[],
        metavar="PATH",
        help="also load this model and compare its KV bytes per token (repeatable)",
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
