"""The grammar library's view of kvfit's tokenizer: the bytes each token id stands for, and the stop ids.

llguidance reads tokenizer.json itself (the Rust `tokenizers` library inside it) for byte-level BPE
(GPT-2, Llama 3, Qwen) and sentencepiece byte-fallback vocabularies (Llama 2, Mistral). A
Metaspace-only decoder (a sentencepiece Unigram without byte pieces) it refuses; for those kvfit
hands it the token bytes itself ("▁" read as a space). Ids past the tokenizer's vocabulary up to the
model's vocab_size (padded embedding rows) are tokens of no bytes, never allowed by any mask.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance

from kvfit.errors import ConfigError


def _metaspace_replacement(decoder: dict | None) -> str | None:
    """The Metaspace replacement character when the decoder is (or contains) a Metaspace step."""
    if not decoder:
        return None
    if decoder.get("type") == "Metaspace":
        return decoder.get("replacement", "\u2581")
    if decoder.get("type") == "Sequence":
        found = [_metaspace_replacement(d) for d in decoder.get("decoders", [])]
        return next((r for r in found if r is not None), None)
    return None


class _MetaspaceVocab:
    """What llguidance.TokenizerWrapper reads: eos/bos ids, the bytes of every id, special ids, encode."""

    def __init__(self, backend, vocab_size: int, eos_token_id: int, replacement: str):
        added = backend.get_added_tokens_decoder()          # {id: AddedToken}
        self.eos_token_id, self.bos_token_id = eos_token_id, None
        self.special_token_ids = sorted(i for i, t in added.items() if t.special)
        self.tokens = [b""] * vocab_size
        for token, token_id in backend.get_vocab(with_added_tokens=True).items():
            if token_id < vocab_size:
                text = token if token_id in added else token.replace(replacement, " ")
                self.tokens[token_id] = text.encode("utf-8")
        self._encoder = _no_prepended_space(backend)

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance needs ids whose bytes are exactly `text`: so no "▁" put in front of it
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encoder.encode(text, add_special_tokens=False).ids


def _no_prepended_space(backend):
    """A copy of backend whose Metaspace pre-tokenizer never prepends "▁" to the text."""
    from tokenizers import Tokenizer as Backend

    def never(node):
        if isinstance(node, dict):
            if node.get("type") == "Metaspace":
                node["prepend_scheme"] = "never"
            for value in node.values():
                never(value)
        elif isinstance(node, list):
            for item in node:
                never(item)
    state = json.loads(backend.to_str())
    never(state.get("pre_tokenizer"))
    return Backend.from_str(json.dumps(state))


def build_ll_tokenizer(backend, vocab_size: int, stop_token_ids: Sequence[int]) -> "llguidance.LLTokenizer":
    """llguidance's tokenizer for a tokenizers.Tokenizer, masks of vocab_size bits, EOS = stop_token_ids.

    ConfigError when the tokenizer has more ids than the model, or a decoder no path here reads. Added tokens past
    the model's rows (special tokens transformers appends: the model never samples them) are left out.
    """
    num_tokens = backend.get_vocab_size(with_added_tokens=True)
    if num_tokens > vocab_size:
        from tokenizers import Tokenizer as Backend
        state = json.loads(backend.to_str())
        state["added_tokens"] = [t for t in state.get("added_tokens") or [] if t.get("id", 0) < vocab_size]
        backend = Backend.from_str(json.dumps(state))
        num_tokens = backend.get_vocab_size(with_added_tokens=True)
    if num_tokens > vocab_size:
        raise ConfigError(f"the tokenizer has {num_tokens} tokens but the model's vocab_size is {vocab_size}; "
                          "structured outputs need every token id to be a model output row")
    stops = list(stop_token_ids)
    if not stops:
        raise ConfigError("structured outputs need an end-of-sequence token id; the tokenizer config names no "
                          "eos_token")
    serialized = backend.to_str()
    try:
        return llguidance.LLTokenizer(serialized, n_vocab=vocab_size, eos_token=stops)
    except ValueError as exc:
        replacement = _metaspace_replacement(json.loads(serialized).get("decoder"))
        if replacement is None:
            raise ConfigError(f"structured outputs cannot read this tokenizer ({exc}); byte-level BPE, "
                              "sentencepiece byte-fallback and Metaspace decoders are supported") from None
    wrapper = llguidance.TokenizerWrapper(_MetaspaceVocab(backend, vocab_size, stops[0], replacement))
    return llguidance.LLTokenizer(wrapper, eos_token=stops)
