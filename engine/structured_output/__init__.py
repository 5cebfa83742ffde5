"""Structured output: a grammar that a request's output must follow, enforced
one token at a time.

A request's `StructuredOutputsParams` is compiled by xgrammar once per distinct
spec (`StructuredOutputManager`). Each request then keeps a matcher, its place
in the grammar (`StructuredOutputRequest`). Before a step, the matcher of every
row that samples writes a bitmask of the tokens it allows; the sampler sends
every other token's logit to minus infinity; after the step, the matcher
accepts the token that was chosen.

Nothing here imports xgrammar until a request asks for structured output:
importing it takes seconds.
"""

from engine.structured_output.manager import StructuredOutputManager
from engine.structured_output.request import StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]
