"""The KV cache: how blocks are named (hashing), who holds which (the block
manager), what one block of each layer holds (the specs) and the tensors
themselves (the pool)."""
