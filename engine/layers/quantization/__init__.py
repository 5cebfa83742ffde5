"""Weights stored in fewer bits than the model computes in: DeepSeek's block-scaled FP8,
DeepSeek-V4's FP4 routed experts, and weight-only int8 and int4."""
