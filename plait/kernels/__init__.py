"""Triton kernels for the GPU path; each has a torch reference beside it and a test comparing them."""
