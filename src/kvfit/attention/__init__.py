"""Attention backends: write K/V into cache slots and attend over block tables."""

from kvfit.attention.base import AttentionBackend, AttentionMetadata
from kvfit.attention.registry import get_backend, backend_names

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "backend_names"]
