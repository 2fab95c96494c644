"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar (llguidance).

The request side is kvfit.structured_params.StructuredOutputsParams (held by SamplingParams). Per
engine, StructuredOutputs(tokenizer, vocab_size) compiles specs (cached, off the engine thread) into
Matchers; each step the runner fills a bitmask row per constrained request and applies it to the logits
before sampling. docs/structured_outputs.md says why llguidance and what it measured.

The names below are imported on first use: structured.validate runs in a fork server that must not
import torch (which bitmask and matcher need).
"""

from kvfit.structured_params import StructuredOutputsParams

_LAZY = {"allocate_bitmask": "bitmask", "apply_bitmask": "bitmask", "bitmask_words": "bitmask",
         "CompiledGrammar": "matcher", "Matcher": "matcher", "StructuredOutputs": "matcher"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"kvfit.structured.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvfit.structured' has no attribute {name!r}")


__all__ = ["CompiledGrammar", "Matcher", "StructuredOutputs", "StructuredOutputsParams", "allocate_bitmask",
           "apply_bitmask", "bitmask_words"]
