"""Tensor parallelism: how a model is split over ranks, the ranks' process group, and the rank
processes an engine spawns (rank 0 is the engine's own process)."""
