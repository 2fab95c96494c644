"""Attention backends: write K/V into cache slots and attend over block tables.

Backends: `torch` (torch_ref.py, the reference and CPU backend) and `triton` (triton_backend.py,
the GPU backend, launching kvfit.kernels' attention kernels). Each declares the largest element offset
its kernels compute (registry.py).
"""
