"""The prose itself: no result typed by hand, no engine name that the engine lacks,
and a Preface whose chapter status tells the truth.

A number in a paragraph that equals a value some snippet printed or returned
must be a placeholder ({{ result(...) }}, see engine/tools/results.py), or be
listed below with the reason it may stay literal. A name in backticks, or a
code-like name in a Mermaid diagram, must resolve in engine/ through the same
lookup the excerpts use, unless it names something outside the engine.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

from engine.tools.edition import defined_names, resolves, strip_html_comments
from engine.tools.results import PLACEHOLDER
from tests.conftest import ROOT

PAGES = sorted((ROOT / "docs").rglob("*.md"))
IDS = [p.relative_to(ROOT / "docs").as_posix() for p in PAGES]

# ------------------------------------------------------------------ numbers

# (page, number as written) -> why it may stay literal. Cited external figures
# outside a claim-deepseek box, and worked arithmetic that is not in math.
CH01, CH02 = "ch01-batching-and-the-kv-cache.md", "ch02-blocks-and-preemption.md"
CH08 = "ch08-the-service.md"
# (page, phrase) -> why the numbers in that exact phrase may stay literal: a cited
# external figure outside a claim-deepseek box. Only the phrase is spared; the
# same number elsewhere on the page is still checked.
ALLOWED_NUMBERS: dict[tuple[str, str], str] = {
    (CH01, "in about 1,200 lines"): "nano-vllm's size, as its README (linked beside it) gives it",
    (CH02, "blocks of 16 to 64 tokens"): "the PagedAttention paper's block sizes, cited there",
    ("index.md", "from Python 3.9"): "the oldest Python the experiments run on, a version",
    (
        "appendix-a-compression.md",
        "sets `hidden_size` 4096, `num_attention_heads` 32 and `num_key_value_heads` 8, so a head has 128",
    ): "Meta's published Llama-3-8B config, linked beside it; the head size is its arithmetic",
    (
        "ch03-overlap.md",
        "for Llama 3 8B on one H100: 29% of the execution time went to gathering the last step's",
    ): "vLLM's v0.6.0 performance post, linked beside it",
    **{
        ("ch07-correctness.md", phrase): "Thinking Machines' published figures (Defeating "
        "Nondeterminism in LLM Inference, and its batch_invariant_ops README), cited there"
        for phrase in (
            "ran 1,000 completions of one prompt",
            "got 80 unique completions",
            "all 1,000 were identical",
            "26 seconds for their benchmark",
            "55 seconds with batch-invariant kernels",
            "and 42 seconds once attention",
            "1.6 to 2.1 times slower",
            "reports 18 unique samples among 1,000 completions",
        )
    },
    (
        "ch06-approximate-state.md",
        "64 heads with weights that",
    ): "DeepSeek-V3.2-Exp's index_n_heads, from its config, cited in Experiment 22's box",
    (CH01, "stores the same values in 656 bytes"): "FlashMLA's README figure, cited there",
    **{
        (page, "1,979 TFLOPS"): "NVIDIA's published BF16 peak with sparsity, linked beside it "
        "(Experiment 28 records the same figure for the H100)"
        for page in (CH01, CH02)
    },
    (
        CH08,
        "keeping over 90% of requests",
    ): "DistServe's OSDI 2024 abstract: over 90% of requests within latency constraints",
    (CH08, "and 75% more requests handled"): "Mooncake's abstract (arXiv 2407.00079), linked there",
}

NUMBER = re.compile(r"(?<![\w.\-/^])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(%?)(?![\w])")
LABEL = re.compile(  # § has no word boundary before it: it is not a word character
    r"(?:\b(?:Experiments?|Chapters?|Exercises?|Figures?|Tables?|Outputs?|Appendix)|§)"
    r"\s*\d+(?:\.\d+)*(?:\s*(?:–|-|to|and|,|or)\s*§?\d+(?:\.\d+)*)*"
)
YEAR = re.compile(r"\b(?:19[5-9]\d|20[0-4]\d)\b")
FENCED = re.compile(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[ \t]*$", re.M | re.S)
MATH = re.compile(r"\\\(.*?\\\)|\\\[.*?\\\]|\$\$.*?\$\$", re.S)
CODE_SPAN = re.compile(r"`[^`\n]+`")
LINK_TARGET = re.compile(r"\]\([^)]*\)|<https?://[^>]*>|https?://\S+")
ATTRS = re.compile(r"\{[ :.#][^}]*\}|<[^>]+>")
DIRECTIVE = re.compile(r"^\s*--8<--.*$", re.M)


def without_cited_boxes(markdown: str) -> str:
    """Blank out claim-deepseek admonitions: their figures are cited, by design."""
    out, skipping = [], False
    for line in markdown.splitlines():
        if re.match(r"^\s*(!!!|\?\?\?\+?) claim-deepseek\b", line):
            skipping = True
            out.append("")
            continue
        if skipping and (not line.strip() or line.startswith("    ")):
            out.append("")
            continue
        skipping = False
        out.append(line)
    return "\n".join(out)


def without_allowed(page: str, markdown: str) -> str:
    """Blank out the allowlisted phrases of this page (see ALLOWED_NUMBERS)."""
    for (where, phrase), _ in ALLOWED_NUMBERS.items():
        if where == page:
            markdown = markdown.replace(phrase, " " * len(phrase))
    return markdown


def prose(markdown: str) -> str:
    """What a reader reads as prose: no code, math, links' targets, placeholders,
    directives, comments or cited boxes; line breaks kept."""
    keep_lines = lambda m: "\n" * m[0].count("\n")  # noqa: E731
    text = strip_html_comments(markdown)
    text = FENCED.sub(keep_lines, text)
    text = without_cited_boxes(text)
    for pattern in (DIRECTIVE, PLACEHOLDER, MATH, CODE_SPAN, LINK_TARGET, ATTRS, LABEL, YEAR):
        text = pattern.sub(lambda m: " " * 0 + "\n" * m[0].count("\n"), text)
    return text


def significant_digits(digits: str) -> int:
    whole, _, frac = digits.replace(",", "").partition(".")
    if frac:
        return len((whole + frac).lstrip("0"))
    return len(whole.strip("0"))


def numbers_in(text: str) -> list[tuple[int, str]]:
    """(line, number as written) for every number that could be a result:
    two or more significant digits, or any percentage."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in NUMBER.finditer(line):
            written = m[0]
            if m[3] or significant_digits(m[1] + (m[2] or "")) >= 2:
                found.append((number, written))
    return found


def normal(written: str) -> str:
    return written.replace(",", "")


def formatted(value: float) -> set[str]:
    """The ways prose could write a recorded value."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return set()
    forms = {str(value)} if isinstance(value, int) else set()
    for digits in range(4):
        forms.add(f"{value:.{digits}f}")
        forms.add(f"{value * 100:.{digits}f}%")
    return forms


@cache
def recorded_numbers() -> frozenset[str]:
    """Every number printed in any .out, and every value any results file holds."""
    found: set[str] = set()
    for out in ROOT.glob("snippets/ch*/*.out"):
        found |= {normal(w) for _, w in numbers_in(out.read_text())}
    for sidecar in ROOT.glob("snippets/ch*/*.json"):
        for value in json.loads(sidecar.read_text()).values():
            for v in value if isinstance(value, list) else [value]:
                found |= formatted(v)
    return frozenset(found)


def typed_results(page: Path) -> list[str]:
    rel = page.relative_to(ROOT / "docs").as_posix()
    recorded = recorded_numbers()
    return [
        f"docs/{rel}:{line}: {written}"
        for line, written in numbers_in(prose(without_allowed(rel, page.read_text())))
        if normal(written) in recorded
    ]


# The glossary (docs/includes/) defines terms; it states no results.
PROSE_PAGES = [p for p in PAGES if "includes" not in p.parts]


@pytest.mark.parametrize("page", PROSE_PAGES, ids=[p.name for p in PROSE_PAGES])
def test_no_result_is_typed_by_hand(page: Path) -> None:
    typed = typed_results(page)
    assert not typed, (
        "numbers in the prose that equal a recorded result; write a {{ result(...) }} "
        "placeholder, or allow them in tests/test_prose.py with the reason:\n" + "\n".join(typed)
    )


def test_every_allowed_phrase_is_on_its_page() -> None:
    """An allowance outlives its text only by mistake: each phrase must still be there."""
    stale = [
        f"{page}: {phrase!r}"
        for page, phrase in ALLOWED_NUMBERS
        if " ".join(phrase.split()) not in " ".join((ROOT / "docs" / page).read_text().split())
    ]
    assert not stale, "allowed phrases no page contains:\n" + "\n".join(stale)


def test_the_lint_sees_numbers_and_spares_labels() -> None:
    text = prose(
        "Experiment 5, Output 4.3 and Chapters 1–2 (2025) show `16` and \\(3 + 4\\) but waste 50.1% in "
        '1,000 of 3,815 cases; {{ result("ch01/x", "y") }} is 7.\n'
    )
    assert [w for _, w in numbers_in(text)] == ["50.1%", "3,815"]
    assert significant_digits("300") == 1 and significant_digits("0.40") == 2


# ------------------------------------------------------------------ names

# Names from outside the engine that pages may quote in backticks or diagrams.
OUTSIDE_NAMES = {
    # Python and its standard library
    "bytes.rfind",
    "None",
    "True",
    "False",
    "print",
    "dict",
    "list",
    "int",
    "float",
    "str",
    "hashlib",
    "random",
    "OrderedDict",
    "deque",
    "bisect",
    "insort",
    "dataclass",
    "python",
    "main",
    "re",
    "ValueError",
    # torch, triton and the libraries the engine loads with
    "OMP_WAIT_POLICY",  # GNU OpenMP's setting, which torch's CPU operators run under
    "torch",
    "triton",
    "tokenizers",
    "transformers",
    "safetensors",
    "tqdm",
    "mkdocs",
    "index_select",
    "index_copy_",
    "scaled_dot_product_attention",
    "exponential_",
    "enable_gqa",
    "is_causal",
    "attn_mask",
    "float32",
    "bfloat16",
    "float16",
    "inference_mode",
    "torch.compile",
    "torch.Generator",
    "manual_seed",
    "argmax",
    "softmax",
    "topk",
    "DynamicCache",
    "generate",
    "AutoModelForCausalLM",
    "pin_memory",
    "non_blocking",
    "CUDAGraph",
    "cuda",
    "cpu",
    # fields of published checkpoints' config.json
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "q_lora_rank",
    "max_position_embeddings",
    "rope_scaling",
    "rope_theta",
    "eos_token_id",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "tie_word_embeddings",
    "n_group",
    "topk_group",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "compress_rates",
    "sliding_window",
    # names in DeepSeek's and transformers' code that the book cites
    "float8_e4m3",
    "float8_e4m3fn",
    "k_scale_cache",
    "DeepseekV4ForCausalLM",
    # the serving section: the openai client's argument, and the server's environment variable
    "base_url",
    "DEEPINFER_API_KEY",
    # peers' names, quoted when the book compares
    "store_kvcache",
    "slot_mapping",
    "RadixAttention",
    "VLLM_BATCH_INVARIANT",
    "NixlConnector",  # vLLM's KV connectors, Chapter 8
    "LMCacheConnectorV1",
    "save_kv_layer",  # vLLM's KV connector interface, cited in Chapter 8
    "wait_for_save",
    "get_finished",
    "calculate_kv_scales",  # vLLM's FP8 KV-cache option, cited in Chapter 6
    "hash_moe",  # transformers' name for DeepSeek-V4's hash-routed layers, cited in Chapter 6
}
OUTSIDE_PREFIXES = ("torch.", "F.", "nn.", "tl.", "triton.", "np.", "math.", "random.")
FILE_SUFFIX = re.compile(r"\.(py|json|md|txt|out|svg|yml|yaml|toml|safetensors|cfg|ipynb)$")
IDENTIFIER = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(.*\))?$")
REPO_FOLDERS = ("engine/", "snippets/", "docs/", "tests/", ".github/", ".ci/")


@cache
def engine_names() -> frozenset[str]:
    return frozenset(defined_names(ROOT))


def dangling(ref: str) -> str | None:
    """Why a quoted name does not resolve, or None when it does (or is not ours)."""
    ref = ref.strip()
    if "/" in ref or FILE_SUFFIX.search(ref):
        path, _, member = ref.split()[0].rstrip(":").partition("::")
        if "*" in path or "NN" in path:
            return None  # a pattern, such as snippets/chNN/demo_*.py
        if path.startswith(REPO_FOLDERS) and not (ROOT / path).exists():
            return f"{path} does not exist"
        if member and path.startswith(REPO_FOLDERS):  # a test or function in that file
            defined = rf"^\s*(?:async )?def {re.escape(member)}\b"
            if not re.search(defined, (ROOT / path).read_text(), re.M):
                return f"{path} defines no {member}"
        return None
    name = ref.split("=")[0] if re.match(r"^\w+=", ref) else ref
    if not IDENTIFIER.match(name):
        return None  # a command, an expression, a value: not a name
    bare = name.split("(")[0]
    if bare in OUTSIDE_NAMES or bare.startswith(OUTSIDE_PREFIXES):
        return None
    if resolves(bare, engine_names()):
        return None
    return f"{bare} is defined nowhere in engine/"


def code_spans(markdown: str) -> list[tuple[int, str]]:
    text = FENCED.sub(lambda m: "\n" * m[0].count("\n"), strip_html_comments(markdown))
    text = DIRECTIVE.sub("", text)
    return [
        (number, m[0].strip("`"))
        for number, line in enumerate(text.splitlines(), 1)
        for m in CODE_SPAN.finditer(line)
    ]


MERMAID = re.compile(r"^([ \t]*)```mermaid\n(.*?)^\1```", re.M | re.S)
CODE_LIKE = re.compile(
    r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?"  # dotted
    r"|\b[A-Za-z_]\w*\(\)"  # called
    r"|\b[a-z]+(?:_[a-z0-9]+)+\b"  # snake_case
    r"|\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+\b"  # CamelCase of two humps or more
)


def mermaid_names(markdown: str) -> list[tuple[int, str]]:
    found = []
    for block in MERMAID.finditer(strip_html_comments(markdown)):
        first = markdown[: block.start(2)].count("\n") + 1
        for offset, line in enumerate(block[2].splitlines()):
            line = re.sub(r"<br\s*/?>", " ", line)
            found += [(first + offset, m[0]) for m in CODE_LIKE.finditer(line)]
    return found


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_engine_name_in_the_prose_exists(page: Path) -> None:
    rel = page.relative_to(ROOT).as_posix()
    markdown = page.read_text()
    problems = [
        f"{rel}:{line}: `{ref}`: {why}"
        for line, ref in code_spans(markdown) + mermaid_names(markdown)
        if (why := dangling(ref))
    ]
    assert not problems, (
        "names the engine does not define (rename them, or add a name from outside the "
        "engine to OUTSIDE_NAMES in tests/test_prose.py):\n" + "\n".join(problems)
    )


def test_the_name_check_catches_a_rename() -> None:
    assert dangling("Scheduler.schedule") is None
    assert dangling("BlockManager.allocate(seq, n)") is None
    assert dangling("enable_prefix_caching=False") is None
    assert dangling("Scheduler.schedule_harder") is not None
    assert dangling("match_prefixes") is not None
    assert dangling("engine/no_such_module.py") is not None
    assert dangling("make test") is None and dangling("config.json") is None
    names = [
        n for _, n in mermaid_names("```mermaid\nA[LLM.generate] --> B[add_sequence()]\n```\n")
    ]
    assert names == ["LLM.generate", "add_sequence()"]
