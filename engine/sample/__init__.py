"""Sampling: the next token of every row of a step, for the whole batch at once
(sampler.py), after the logits' adjustments (penalties.py, logit_bias.py); the
check of drafts that were sampled from a distribution q (rejection_sampler.py);
and the logprobs of prompt tokens a request asks for (prompt_logprobs.py)."""
