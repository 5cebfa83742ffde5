"""Expert parallelism across processes, and the placement of experts on ranks (EPLB)."""
