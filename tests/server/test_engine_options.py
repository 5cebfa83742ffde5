"""Engine options a server takes on its command line: `--async-scheduling` and
`--disable-any-whitespace` reach EngineConfig, what async scheduling cannot run
with is refused as a one-line error, and with `--disable-any-whitespace` an
OpenAI client's response_format gets JSON without free whitespace, no extra
field in its request."""

from __future__ import annotations

import httpx
import pytest

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from engine.tools.cli import build_parser, main, serve_engine_config
from tests.engine.test_structured_output import free_whitespace
from tests.server.conftest import TINY, in_thread

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "people": {"type": "array"}},
    "required": ["city", "people"],
}
FORMATS = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}},
]


def test_serve_flags_set_the_engine_config() -> None:
    on = build_parser().parse_args(
        ["serve", str(TINY), "--async-scheduling", "--disable-any-whitespace"]
    )
    config = serve_engine_config(on)
    assert config.async_scheduling and config.disable_any_whitespace
    off = serve_engine_config(build_parser().parse_args(["serve", str(TINY)]))
    assert not off.async_scheduling and not off.disable_any_whitespace


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], "spec"),
        (["--kv-store", "kv-store-never-made"], "kv_store"),
    ],
)
def test_serve_refuses_async_scheduling_with_what_it_cannot_run(capsys, extra, named) -> None:
    assert main(["serve", str(TINY), "--async-scheduling", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and "async_scheduling=False" in err
    assert len(err.strip().splitlines()) == 1  # a message, no traceback


def json_replies(disable_any_whitespace: bool) -> list[str]:
    """Seeded chat replies under each response_format, from a server on the option."""
    config = EngineConfig(
        model=str(TINY),
        dtype="float32",
        num_kv_blocks=256,
        disable_any_whitespace=disable_any_whitespace,
    )
    replies = []
    with in_thread(build_app(ServerConfig(config))) as url:
        for fmt in FORMATS:
            for seed in range(6):
                body = {
                    "model": "deepinfer-tiny",
                    "messages": [{"role": "user", "content": "A place, as JSON."}],
                    "max_tokens": 60,
                    "temperature": 1.0,
                    "seed": seed,
                    "response_format": fmt,
                }
                reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
                assert reply.status_code == 200, reply.text
                replies.append(reply.json()["choices"][0]["message"]["content"])
    return replies


def test_response_format_gets_json_without_free_whitespace_on_a_server_with_the_option() -> None:
    compact = json_replies(disable_any_whitespace=True)
    assert not [text for text in compact if free_whitespace(text)]
    loose = json_replies(disable_any_whitespace=False)
    assert sum(len(free_whitespace(text)) for text in loose) > 0
