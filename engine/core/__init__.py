"""The engine loop: schedule, execute, update, output (LLMEngine, and AsyncLoop
one step ahead); the output processor and detokenizer that make text; the
request checks; and the trace that watches the steps."""
