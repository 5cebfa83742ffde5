"""The model runner: one step's batch flattened, run and sampled; its one-step-ahead
half, the future tokens that half reads, and the two fast paths for decode
steps (CUDA graphs and the compiled decode)."""
