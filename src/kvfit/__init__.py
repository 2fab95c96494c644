"""kvfit: an LLM inference engine whose paged KV cache is sized from the memory it measures."""

from kvfit.version import __version__


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
