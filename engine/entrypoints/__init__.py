"""The engine's front ends: `deepinfer serve` (an OpenAI-compatible HTTP server
over one engine) and `deepinfer router` (one address in front of several).

The engine core knows nothing of them: nothing outside this package and the
command line imports it. The server runs the core in a thread of its own and
keeps the HTTP side, tokenization, chat templates and detokenization in the
asyncio loop, as vLLM's and SGLang's front ends do.
"""
