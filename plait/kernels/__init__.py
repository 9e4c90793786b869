"""Triton kernels for the GPU path, each with a torch reference beside it.

Kept import-light on purpose: nothing here imports triton, so ``import plait`` never needs it.
Import the kernel modules themselves (``plait.kernels.paged_attention``, ...) where triton is wanted.
"""
