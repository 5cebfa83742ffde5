"""The server's side of prefill/decode disaggregation (Chapter 8): what a
request's kv_transfer_params ask, checked, and a prefill worker's reply.

A handed-on request is one choice of one prompt, and carries nothing the
receiver could not rebuild from its tokens: no logprobs (the sender's are not
handed on), no echo, no structured output (its grammar's state would have to
be replayed). Those requests a router serves on one worker, whole.
"""

from __future__ import annotations

from engine.entrypoints.errors import bad_request
from engine.entrypoints.protocol import CompletionRequest, KVTransferParams
from engine.kv.handoff import Handoff
from engine.kv.store_connector import block_chain
from engine.outputs import RequestOutput

PARAM = "kv_transfer_params"


def check_transfer(req: CompletionRequest, num_prompts: int, has_store: bool) -> None:
    """A 400 for a request kv_transfer_params cannot carry, or a server without a store."""
    if not has_store:
        raise bad_request("kv_transfer_params needs a server started with --kv-store", PARAM)
    unsupported = {
        "n": req.n != 1 or num_prompts != 1,
        "logprobs": req.logprobs is not None,
        "prompt_logprobs": req.prompt_logprobs is not None,
        "echo": req.echo,
        "structured outputs": req.response_format is not None
        or req.structured_outputs is not None
        or any(
            g is not None
            for g in (req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
        ),
    }
    for name, found in unsupported.items():
        if found:
            raise bad_request(f"kv_transfer_params does not carry {name}: send it plain", PARAM)
    transfer = req.kv_transfer_params
    if transfer.do_remote_decode and transfer.output_token_ids is not None:
        raise bad_request(
            "kv_transfer_params: do_remote_decode or output_token_ids, not both", PARAM
        )


def handoff_of(transfer: KVTransferParams) -> Handoff | None:
    """What a decode worker continues from; None for a prefill request."""
    if transfer.output_token_ids is None:
        return None
    try:
        hashes = [bytes.fromhex(h) for h in transfer.block_hashes]
        return Handoff(list(transfer.output_token_ids), transfer.num_sent_tokens, hashes)
    except ValueError as err:
        raise bad_request(f"kv_transfer_params: {err}", PARAM) from None


def prefill_reply(out: RequestOutput, seed: int, root: bytes, block_size: int) -> KVTransferParams:
    """A prefill worker's reply: its first token, its chain over the prompt's
    full blocks (saved to the store before this reply), and its seed."""
    ids = out.prompt_token_ids
    chain = block_chain(root, ids, block_size, len(ids) // block_size)
    return KVTransferParams(
        output_token_ids=list(out.token_ids), block_hashes=[h.hex() for h in chain], seed=seed
    )
