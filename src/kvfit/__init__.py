"""kvfit: an LLM inference engine whose paged KV cache is sized from the memory it measures."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("kvfit")       # the one version: pyproject.toml's, as installed
except _metadata.PackageNotFoundError:             # run from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name):
    # LLM pulls in torch; `kvfit plan` must not pay for it, so import on first use.
    if name == "LLM":
        from kvfit.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kvfit.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'kvfit' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]
