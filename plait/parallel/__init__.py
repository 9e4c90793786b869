"""Tensor parallelism (vLLM's --tensor-parallel-size): a process a device, each with a slice of each layer."""
