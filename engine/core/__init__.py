"""The engine loop: schedule, execute, update, output; the executor that runs
the model runners, the output processor and detokenizer that make text, and
the stats and trace that watch the steps."""
