"""Triton kernels for the GPU path, each with a torch reference beside it."""
