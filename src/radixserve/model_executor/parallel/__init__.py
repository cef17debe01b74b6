"""Tensor parallelism: weight sharding, the process group, the multi-process runner."""
