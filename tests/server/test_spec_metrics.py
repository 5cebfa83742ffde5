"""A server that speculates: `deepinfer serve --speculative-config` as a user
starts it, answering with the text a server without speculation gives, and
/metrics counting drafts, acceptances, accepted lengths and chosen lengths
consistently with one another."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import SERVE_ARGS, TINY, auth, metric, running

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPTS = [
    "def free(self, seq):\n    for block_id in seq.block_table:\n        self._release(block_id)\n",
    "The scheduler admits a request. The scheduler admits a request while the budget lasts.",
]


def complete(url: str, prompt: str, headers: dict | None = None) -> str:
    body = {"model": "deepinfer-tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_speculating_server_answers_as_a_plain_one_and_counts_its_drafts(server) -> None:
    spec_args = [*SERVE_ARGS, "--speculative-config", json.dumps(SPEC)]
    with running(("serve", str(TINY), *spec_args)) as (spec,):
        for prompt in PROMPTS:
            assert complete(spec.url, prompt) == complete(server.url, prompt, auth())
        m = lambda name: metric(spec.url, "deepinfer:spec_decode_" + name)  # noqa: E731
        drafted, accepted = m("num_draft_tokens_total"), m("num_accepted_tokens_total")
        steps = m("num_drafts_total")
        assert 0 < accepted <= drafted
        assert m("accepted_length_count") == steps > 0
        assert m("accepted_length_sum") == accepted
        assert m("chosen_length_sum") == drafted  # every chosen draft was verified
        assert m("chosen_length_count") >= steps  # a request given none still counts
        assert 0 < m("forwards_per_output_token") < 1  # accepted drafts saved steps
