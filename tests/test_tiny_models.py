"""The tiny models the repository trains and ships (snippets/models/train_tiny.py and
train_tiny_moe.py).

Every folder loads offline in the engine and in transformers, the engine's greedy
tokens equal transformers' greedy generate on them, their sizes and parameter counts
are in range, they share one tokenizer, and the training records report the targets
met, from the figures themselves. The MoE model's MTP module, which transformers
ignores, loads in the engine and equals its float64 reference.
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
TARGET, DRAFT, MOE = "deepinfer-tiny", "deepinfer-tiny-draft", "deepinfer-tiny-moe"
PARAMETERS = {
    TARGET: (3_000_000, 8_000_000),
    DRAFT: (500_000, 1_500_000),
    MOE: (2_000_000, 4_000_000),  # the main model; its MTP module is counted apart
}
ARCHITECTURES = {
    TARGET: "Qwen3ForCausalLM",
    DRAFT: "Qwen3ForCausalLM",
    MOE: "DeepseekV3ForCausalLM",
}
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


@pytest.fixture(scope="module", params=[TARGET, DRAFT, MOE])
def hf_model(request) -> tuple[str, torch.nn.Module]:
    """(name, transformers model in float32), loaded from the folder alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        MODELS / request.param, dtype=torch.float32, local_files_only=True
    )
    return request.param, model.eval()


@pytest.mark.parametrize("name", [TARGET, DRAFT, MOE])
def test_folder_is_a_float16_checkpoint(name: str) -> None:
    folder = MODELS / name
    assert all((folder / f).is_file() for f in FILES), sorted(p.name for p in folder.iterdir())
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[name]]
    assert config["dtype"] == "float16"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"F16"}


def test_shipped_size_under_20_mb() -> None:
    """The two dense models took about 11 MB; issue 11 gave the MoE model up to 8 more."""
    files = [p for p in MODELS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    total = sum(p.stat().st_size for p in files)
    assert total < 20 * 1024 * 1024, f"snippets/models holds {total / 1e6:.1f} MB"


def test_moe_model_is_deepseek_v3_with_one_mtp_module_under_8_mb(records) -> None:
    folder = MODELS / MOE
    config = json.loads((folder / "config.json").read_text())
    n = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    assert config["n_routed_experts"] == 16 and config["n_group"] == 4
    assert config["kv_lora_rank"] == 64 and config["qk_rope_head_dim"] == 16
    assert config["first_k_dense_replace"] == 1 and config["n_shared_experts"] == 1
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    mtp = {k for k in names if k.startswith(f"model.layers.{n}.")}
    assert {f"model.layers.{n}.{part}.weight" for part in ("enorm", "hnorm", "eh_proj")} <= mtp
    assert f"model.layers.{n}.mlp.experts.15.down_proj.weight" in mtp
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 8_000_000
    assert records["models"][MOE]["bytes_on_disk"] == sum(
        p.stat().st_size for p in folder.iterdir()
    )


def test_one_tokenizer_in_range_for_all() -> None:
    from transformers import AutoTokenizer

    target, draft, moe = (MODELS / n / "tokenizer.json" for n in (TARGET, DRAFT, MOE))
    assert target.read_bytes() == draft.read_bytes() == moe.read_bytes()
    tok = Tokenizer.from_file(str(target))
    assert 2000 <= tok.get_vocab_size() <= 8000
    eot = tok.token_to_id("<|endoftext|>")
    assert eot is not None
    text = "def schedule(self) -> None:\n    é ∑ 🙂\n"
    assert tok.decode(tok.encode(text).ids) == text  # byte level: nothing is lost
    for name in (TARGET, DRAFT, MOE):
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
    llm = LLM(MODELS / name, dtype="float32", num_kv_blocks=64, max_num_seqs=8)
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


def test_moe_records_report_targets_met(records) -> None:
    moe = records["models"][MOE]
    training, evaluation = moe["training"], moe["evaluation"]
    assert training["steps_done"] == training["steps_planned"], "cut short"
    unigram = records["evaluation"]["unigram_perplexity"]
    assert unigram / evaluation["perplexity"] >= 5
    assert evaluation["perplexity_ratio"] == round(unigram / evaluation["perplexity"], 4)
    mtp = evaluation["mtp"]
    assert mtp["positions"] == records["evaluation"]["positions"] - records["evaluation"]["windows"]
    assert 0 < mtp["agreement"] <= 1
    # The MTP module learned: its next-next token is right far more often than the
    # commonest held-out token (a newline, 4% of the text) would give.
    assert mtp["mtp_accuracy"] > 0.1 and mtp["main_accuracy"] > 0.1
    # The load of every MoE layer (and the MTP module's), with the learned routing
    # biases and with them zeroed; the biases make it more even in every layer.
    load = evaluation["load"]
    with_bias, without = load["with_bias"], load["without_bias"]
    assert len(load["layers"]) == len(with_bias["counts"]) == len(without["counts"])
    for layer, a, b in zip(load["layers"], with_bias["max_violation"], without["max_violation"]):
        assert a < b, f"layer {layer}: max violation {a} with the biases, {b} without"
    assert all(len(row["max_violation"]) == len(load["layers"]) for row in training["log"])


def test_moe_mtp_module_matches_its_float64_reference() -> None:
    """The shipped MTP module as the engine loads it, against deepseek_reference on
    the shipped tensors: the names, the per-expert packing and the shared embedding
    and head are read as training wrote them."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tests.engine import deepseek_reference as ref
    from tests.engine.test_mtp import bind_mtp_caches, run, step_meta

    folder = MODELS / MOE
    llm = LLM(folder, dtype="float32", block_size=16, num_kv_blocks=8)
    bind_mtp_caches(llm)  # the MTP module gets blocks only from something that drafts
    runner, tok = llm.llm_engine.executor.model_runner, llm.tokenizer
    model = runner.model
    ids = torch.tensor(tok.encode("def schedule(self) -> SchedulerOutput:\n    budget =").ids)
    pos = torch.arange(len(ids))
    hidden = run(runner, step_meta(pos.tolist(), len(ids), False), lambda: model(ids, pos))
    meta = step_meta(pos[:-1].tolist(), len(ids) - 1, False)
    got = run(runner, meta, lambda: model.mtp_logits(pos[:-1], hidden[:-1], ids[1:]))
    cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    cfg.rope_theta = cfg.rope_parameters["rope_theta"]
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied
    expected = ref.mtp_logits(hidden[:-1], ids[1:], tensors, cfg)
    err = (got.double() - expected).abs().max().item()
    assert err < 1e-3, f"max |logit difference| {err:.2e}"


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
