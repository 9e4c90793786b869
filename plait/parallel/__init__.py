"""Tensor parallelism (vLLM's --tensor-parallel-size): one process a device, each holding a slice of every layer."""
