"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar (llguidance).

The request side is kvfit.structured_params.StructuredOutputsParams (held by SamplingParams). Per
engine, StructuredOutputs(tokenizer, vocab_size) compiles specs (cached) into Matchers; each step the
runner fills a bitmask row per constrained request and applies it to the logits before sampling.
docs/structured_outputs.md says why llguidance and what it measured.
"""

from kvfit.structured.bitmask import allocate_bitmask, apply_bitmask, bitmask_words
from kvfit.structured.matcher import CompiledGrammar, Matcher, StructuredOutputs
from kvfit.structured_params import StructuredOutputsParams

__all__ = ["CompiledGrammar", "Matcher", "StructuredOutputs", "StructuredOutputsParams", "allocate_bitmask",
           "apply_bitmask", "bitmask_words"]
