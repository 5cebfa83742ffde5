"""Tools around the engine: the `deepinfer` command, benchmarks, and the book's
edition checker. Nothing in the engine's core imports this package."""
