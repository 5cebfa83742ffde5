"""The tiny models the repository trains and ships (snippets/models/train_tiny.py).

Both folders load offline in the engine and in transformers, the engine's greedy
tokens equal transformers' greedy generate on them, their sizes and parameter counts
are in range, they share one tokenizer, and the training records report the targets
met, from the figures themselves.
"""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported, if it is not yet
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

MODELS = ROOT / "snippets" / "models"
TARGET, DRAFT = "deepinfer-tiny", "deepinfer-tiny-draft"
PARAMETERS = {TARGET: (3_000_000, 8_000_000), DRAFT: (500_000, 1_500_000)}
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
PROMPTS = ["def schedule", "The KV cache", "import torch\n", "    return"]
MAX_TOKENS = 16


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def records() -> dict:
    return json.loads((MODELS / "records.json").read_text())


@pytest.fixture(scope="module", params=[TARGET, DRAFT])
def hf_model(request) -> tuple[str, torch.nn.Module]:
    """(name, transformers model in float32), loaded from the folder alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        MODELS / request.param, dtype=torch.float32, local_files_only=True
    )
    return request.param, model.eval()


@pytest.mark.parametrize("name", [TARGET, DRAFT])
def test_folder_is_a_float16_checkpoint(name: str) -> None:
    folder = MODELS / name
    assert all((folder / f).is_file() for f in FILES), sorted(p.name for p in folder.iterdir())
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["dtype"] == "float16"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"F16"}


def test_shipped_size_under_16_mb() -> None:
    files = [p for p in MODELS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    total = sum(p.stat().st_size for p in files)
    assert total < 16 * 1024 * 1024, f"snippets/models holds {total / 1e6:.1f} MB"


def test_one_tokenizer_in_range_for_both() -> None:
    from transformers import AutoTokenizer

    target, draft = (MODELS / n / "tokenizer.json" for n in (TARGET, DRAFT))
    assert target.read_bytes() == draft.read_bytes()
    tok = Tokenizer.from_file(str(target))
    assert 2000 <= tok.get_vocab_size() <= 8000
    eot = tok.token_to_id("<|endoftext|>")
    assert eot is not None
    text = "def schedule(self) -> None:\n    é ∑ 🙂\n"
    assert tok.decode(tok.encode(text).ids) == text  # byte level: nothing is lost
    for name in (TARGET, DRAFT):
        folder = MODELS / name
        config = json.loads((folder / "config.json").read_text())
        assert config["vocab_size"] == tok.get_vocab_size()
        assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == eot
        auto = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        assert auto.eos_token_id == auto.bos_token_id == eot
        assert auto(text)["input_ids"] == tok.encode(text).ids
        assert auto.decode(auto(text)["input_ids"]) == text


def test_parameter_counts(hf_model, records) -> None:
    name, model = hf_model
    count = sum(p.numel() for p in model.parameters())  # tied embeddings once
    low, high = PARAMETERS[name]
    assert low <= count <= high, f"{name}: {count:,} parameters"
    assert records["models"][name]["parameters"] == count


def test_engine_greedy_matches_transformers(hf_model) -> None:
    name, model = hf_model
    llm = LLM(MODELS / name, num_kv_blocks=64, max_num_seqs=8)
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    for prompt, out in zip(PROMPTS, outputs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert out.token_ids == ref[0, ids.shape[1] :].tolist(), f"{name}: {prompt!r}"
    assert any(len(o.text.strip()) > 0 for o in outputs)


def test_records_report_targets_met(records) -> None:
    corpus, evaluation = records["corpus"], records["evaluation"]
    assert len(corpus["commit"]) == 40 and len(corpus["sha256"]) == 64
    assert corpus["train"]["tokens"] > 0 and corpus["heldout"]["tokens"] > 0
    assert not set(corpus["heldout"]["paths"]) & set(corpus["train"]["paths"])
    assert {p.rsplit(".", 1)[1] for p in corpus["heldout"]["paths"]} == {"md", "py"}
    unigram = evaluation["unigram_perplexity"]
    for name in (TARGET, DRAFT):
        assert evaluation["perplexity"][name] < unigram, name
        training = records["models"][name]["training"]
        assert training["steps_done"] == training["steps_planned"], f"{name} was cut short"
    assert unigram / evaluation["perplexity"][TARGET] >= 5
    assert evaluation["greedy_agreement"] >= 0.5
    assert (MODELS / "RECORDS.md").is_file()


def test_both_folders_carry_the_training_scripts_chat_template() -> None:
    """A rerun of train_tiny.py writes the same template; transformers renders it."""
    from transformers import AutoTokenizer

    from tests.conftest import load_script

    template = load_script(MODELS / "train_tiny.py", "train_tiny").CHAT_TEMPLATE
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    for name in (TARGET, DRAFT):
        config = json.loads((MODELS / name / "tokenizer_config.json").read_text())
        assert config["chat_template"] == template, name
        auto = AutoTokenizer.from_pretrained(MODELS / name, local_files_only=True)
        text = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == "Be brief.\n\nQ: Why?\nA:", name
