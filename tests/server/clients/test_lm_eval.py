"""lm-eval-harness 0.4 against the server, as its users run it: the
local-completions model on a local JSONL task, with the tokenizer it finds at
/tokenizer_info and /tokenize. Its loglikelihoods must be the engine's own
prompt logprobs (within 1e-5), its multiple-choice accuracy the accuracy
computed from them directly, and its generate_until replies the engine's
greedy text."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from tests.server.clients.conftest import MODEL
from tests.server.conftest import TINY

DOCS = [
    {"question": "The cache holds", "choices": ["keys", "values", "blocks"], "answer": 2},
    {"question": "A block is", "choices": ["a page", "a token", "a step"], "answer": 0},
    {"question": "The scheduler decides", "choices": ["which run", "what is", "how"], "answer": 1},
    {"question": "def free(self", "choices": [", block", "):", ") ->"], "answer": 1},
]
TASKS = {
    "tiny_loglikelihood": """
output_type: loglikelihood
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
target_delimiter: " "
metric_list:
  - metric: perplexity
  - metric: acc
""",
    "tiny_choice": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "tiny_generate": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def results(server, tmp_path_factory) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, body in TASKS.items():
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        head += f"    test: {data}\ntest_split: test\n"
        (folder / f"{name}.yaml").write_text(head + body)
    base = f"model={MODEL},base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1"
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=base,  # the tokenizer: found at /tokenizer_info (remote backend)
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
    )
    out["requests"] = server.record("lm_eval")
    return out


@pytest.fixture(scope="module")
def oracle():
    llm = LLM(TINY, dtype="float32", num_kv_blocks=64, max_model_len=128)
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))

    def loglikelihood(context: str, continuation: str) -> float:
        """lm-eval's split (TemplateLM._encode_pair): the whole text's tokens
        after the context's own; the sum of the engine's prompt logprobs there."""
        context_ids = tok.encode(context).ids
        whole = tok.encode(context + continuation).ids
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        [out] = llm.generate([whole], params, use_tqdm=False)
        start = len(context_ids)
        return sum(out.prompt_logprobs[i][t] for i, t in enumerate(whole) if i >= start)

    def greedy(prompt: str) -> str:
        params = SamplingParams(temperature=0, max_tokens=8, stop=["\n"])
        return llm.generate([prompt], params, use_tqdm=False)[0].text

    return loglikelihood, greedy


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_lm_eval_uses_the_servers_tokenizer_and_echo(results) -> None:
    paths = {r["path"] for r in results["requests"]}
    assert {"/tokenize", "/v1/completions"} <= paths
    scoring = [r["body"] for r in results["requests"] if r["body"].get("echo")]
    assert scoring and all(b["logprobs"] >= 1 for b in scoring)


def test_loglikelihood_is_the_engines_prompt_logprobs(results, oracle) -> None:
    loglikelihood, _ = oracle
    gaps = []
    for sample in samples(results, "tiny_loglikelihood"):
        context, continuation = sample["arguments"][0][:2]
        [[(ll, _greedy)]] = sample["resps"]
        gaps.append(abs(ll - loglikelihood(context, continuation)))
    print(f"largest |lm-eval - engine| loglikelihood: {max(gaps):.1e}")
    assert max(gaps) < 1e-5


def test_multiple_choice_accuracy_is_the_direct_one(results, oracle) -> None:
    loglikelihood, _ = oracle
    right = 0
    for sample in samples(results, "tiny_choice"):
        doc = sample["doc"]
        lls = [loglikelihood(doc["question"], " " + c) for c in doc["choices"]]
        served = [resp[0][0] for resp in sample["resps"]]
        assert max(abs(a - b) for a, b in zip(served, lls)) < 1e-5
        right += lls.index(max(lls)) == doc["answer"]
    assert results["results"]["tiny_choice"]["acc,none"] == right / len(DOCS)


def test_generate_until_is_the_engines_greedy_text(results, oracle) -> None:
    _, greedy = oracle
    for sample in samples(results, "tiny_generate"):
        [[text]] = sample["resps"]
        assert text == greedy(sample["doc"]["question"])
