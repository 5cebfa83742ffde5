"""Weights stored in fewer bits than the model computes in: DeepSeek's block-scaled FP8."""
