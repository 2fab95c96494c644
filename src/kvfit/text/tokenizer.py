"""Tokenizer: tokenizer.json (the `tokenizers` library) plus tokenizer_config.json, as transformers reads them.

Special tokens follow transformers 5 (5.25): with a tokenizer.json, tokenizer_config.json's add_bos_token /
add_eos_token are dropped (tokenization_utils_base's _from_pretrained pops them), so tokenizer.json's
post-processor decides whatever the flags say, and one without a post-processor adds none. A few
tokenizer classes set the post-processor from their own constructor defaults instead
(CLASS_SPECIAL_TOKENS). vLLM encodes with the same AutoTokenizer, so its ids are these too.
The chat template comes from chat_template.jinja if present, else tokenizer_config.json's chat_template.

One family is read through transformers itself: a Qwen2 / Qwen3 (MoE) folder may load as Qwen2Tokenizer, whose
constructor rebuilds the pipeline in code (NFC, its split pattern, byte-level BPE; <|endoftext|> added) whatever
tokenizer.json holds; which folders it takes depends on the transformers release and on tokenizer_config.json's
tokenizer_class (tokenization_auto). A tokenizer.json already in that shape (every Qwen release) is read as it is;
any other such folder is loaded with AutoTokenizer, once, and its backend used (transformers_backend).
"""

from __future__ import annotations

import json
import os

from kvfit.errors import ConfigError, RequestError
from kvfit.model_facts import read_field, read_json_object
from kvfit.text.chat_template import compile_chat_template, render_chat_template

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# named special tokens that need not be in the model's embeddings (a prompt holding one is refused when sent)
OTHER_SPECIAL_TOKEN_KEYS = ("cls_token", "sep_token", "mask_token")
# tokenizer classes (tokenizer_config.json's tokenizer_class, "Fast" dropped) whose transformers 5 constructor
# rebuilds the post-processor from its own (add_bos_token, add_eos_token) defaults, the config's being dropped
CLASS_SPECIAL_TOKENS = {"CodeLlamaTokenizer": (True, False), "GPTNeoXTokenizer": (False, False),
                        "ErgoTokenizer": (False, False)}
# the clean-up transformers applies on decode when clean_up_tokenization_spaces is set (never for BPE)
CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


# when transformers 5 (5.17-5.25) loads a folder as Qwen2Tokenizer, rebuilt in code (see the module's doc): qwen2
# whatever tokenizer_class says (its list of model types with a wrong Hub class); the other Qwen types when
# tokenizer_config.json names Qwen2Tokenizer or no class; any type that names Qwen2Tokenizer
QWEN2_ALWAYS = frozenset({"qwen2"})
QWEN2_UNLESS_NAMED = frozenset({"qwen2_moe", "qwen3", "qwen3_moe"})
QWEN2_CLASS = "Qwen2Tokenizer"
# the split pattern of Qwen2Tokenizer (and of every Qwen release's tokenizer.json)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def rebuilt_as_qwen2(model_type, tokenizer_class) -> bool:
    """Whether transformers loads a folder of this model type and tokenizer_config.json class as Qwen2Tokenizer."""
    named = tokenizer_class.removesuffix("Fast") if isinstance(tokenizer_class, str) else None
    return (named == QWEN2_CLASS or model_type in QWEN2_ALWAYS
            or (model_type in QWEN2_UNLESS_NAMED and named is None))


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _built_as_qwen2(backend) -> bool:
    """Whether a tokenizer.json has the pipeline Qwen2Tokenizer builds: NFC, a split pattern then byte-level
    pieces, BPE, byte-level decoding (then transformers' rebuild encodes as the file does)."""
    pre = _state(backend.pre_tokenizer) or {}
    parts = pre.get("pretokenizers") or []
    return (type(backend.model).__name__ == "BPE" and _state(backend.normalizer) == {"type": "NFC"}
            and pre.get("type") == "Sequence" and len(parts) == 2
            and parts[0] == {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated",
                             "invert": False}
            and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True)
            and (_state(backend.decoder) or {}).get("type") == "ByteLevel")


def transformers_backend(folder: str, backend, model_type, tokenizer_class) -> tuple[object, dict[str, str]]:
    """(the tokenizers.Tokenizer that transformers' AutoTokenizer encodes this folder with, the special tokens
    it names): the file's own unless transformers rebuilds the folder as Qwen2Tokenizer (rebuilt_as_qwen2) and its
    tokenizer.json is not already in that shape; then AutoTokenizer builds it (vLLM encodes with it too). That
    costs seconds and hundreds of MB in each process that loads it (the engine, the server, its prepare workers);
    without transformers installed, the file is read as it is."""
    if not rebuilt_as_qwen2(model_type, tokenizer_class) or _built_as_qwen2(backend):
        return backend, {}
    try:
        from transformers import AutoTokenizer
    except Exception:            # noqa: BLE001 - not installed, or an import that fails: the file is the best reading
        return backend, {}
    from tokenizers import Tokenizer as Backend
    try:
        hf = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:     # noqa: BLE001 - any failure of the reference loader is the folder's
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"{folder}: transformers could not load its tokenizer ({first}); fix tokenizer.json / "
                          "tokenizer_config.json") from None
    inner = getattr(hf, "backend_tokenizer", None)
    if inner is None:
        return backend, {}
    named = {key: str(getattr(hf, key)) for key in SPECIAL_TOKEN_KEYS if getattr(hf, key, None)}
    return Backend.from_str(inner.to_str()), named


def _metaspace_marker(backend) -> str | None:
    """The replacement character of a Metaspace pre-tokenizer (alone or in a sequence), else None."""
    pre = _state(backend.pre_tokenizer) or {}
    for part in [pre, *(pre.get("pretokenizers") or [])]:
        if part.get("type") == "Metaspace":
            return part.get("replacement", "\u2581")
    return None


def _special_tokens(config: dict, source: str, keys: tuple[str, ...] = SPECIAL_TOKEN_KEYS) -> dict[str, str]:
    """{key: token text} of the special tokens tokenizer_config.json names (a string or a serialized AddedToken)."""
    tokens = {}
    for key in keys:
        value = config.get(key)
        if isinstance(value, dict):     # a serialized AddedToken
            value = read_field(value, "content", "str", f"{source} {key}", required=True)
        elif value is not None and not isinstance(value, str):
            raise ConfigError(f"{source}: '{key}' must be a token string or an AddedToken object, got {value!r:.60}")
        if value:
            tokens[key] = value
    return tokens


def _read_json(path: str) -> dict:
    return read_json_object(path) if os.path.isfile(path) else {}


def _chat_templates(folder: str, config: dict) -> dict[str, str]:
    """The folder's chat templates by name, as transformers 5 reads them: chat_template.jinja (or
    tokenizer_config.json's chat_template, a text or a list of named ones) is "default"; additional_chat_templates/
    NAME.jinja (save_pretrained writes named ones there) are the others."""
    templates: dict[str, str] = {}
    template = config.get("chat_template")
    if template is not None and not isinstance(template, (str, list)):
        raise ConfigError(f"tokenizer_config.json: 'chat_template' must be a string or a list of named templates, "
                          f"got {type(template).__name__}")
    if isinstance(template, list):
        templates.update({t["name"]: t["template"] for t in template if isinstance(t, dict)
                          and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)})
    elif isinstance(template, str):
        templates["default"] = template
    extra = os.path.join(folder, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra, name), encoding="utf-8") as fh:
                    templates[name[:-len(".jinja")]] = fh.read()
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as fh:
            templates["default"] = fh.read()
    return templates


# transformers' apply_chat_template options that are not template variables (kvfit's returns text or ids only)
HF_CHAT_TEMPLATE_OPTIONS = frozenset({"return_dict", "return_tensors", "padding", "truncation", "max_length",
                                      "tokenizer_kwargs", "return_assistant_tokens_mask"})


class Tokenizer:
    """encode / decode / chat templates for one model folder."""

    def __init__(self, backend, config: dict, chat_template: str | None = None, model_vocab_size: int | None = None):
        """model_vocab_size: the model's token embeddings (config.json vocab_size); every special token must
        have an id below it."""
        source = "tokenizer_config.json"
        self._tok = backend                         # a tokenizers.Tokenizer
        # transformers encodes without a truncation or padding tokenizer.json may hold (a cut prompt would be silent)
        self._tok.no_truncation()
        self._tok.no_padding()
        self.special_tokens = _special_tokens(config, source)
        # transformers' additional (4.x) / extra (5.x) special tokens: in all_special_ids
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        extra = extra.values() if isinstance(extra, dict) else extra if isinstance(extra, list) else []
        self.extra_special_tokens = [t.get("content") if isinstance(t, dict) else t for t in extra
                                     if isinstance(t, str) or (isinstance(t, dict) and isinstance(t.get("content"), str))]
        others = _special_tokens(config, source, OTHER_SPECIAL_TOKEN_KEYS)
        # the template's token variables (transformers passes its whole special_tokens_map)
        self.template_tokens = {**others, **self.special_tokens}
        declared = config.get("added_tokens_decoder")        # transformers' flags win over tokenizer.json's
        declared = [t.get("content") for t in declared.values() if isinstance(t, dict) and t.get("special") is True
                    and isinstance(t.get("content"), str)] if isinstance(declared, dict) else []
        added = {t.content: t.special for t in self._tok.get_added_tokens_decoder().values()}
        special = [*self.special_tokens.values(), *others.values(), *declared]
        unmarked = list(dict.fromkeys([*(s for s in special if not added.get(s, False)),
                                       *(s for s in self.extra_special_tokens if s not in added)]))
        if unmarked:  # as transformers does: one not in tokenizer.json gets the next free id, one held there as a
            self._tok.add_special_tokens(unmarked)      # plain added token becomes special (decode skips it)
        self._check_special_ids(model_vocab_size)
        clean_up = read_field(config, "clean_up_tokenization_spaces", "bool", source, default=False)
        for key in ("add_bos_token", "add_eos_token"):      # type-checked (a corrupt file), then unused, as above
            read_field(config, key, "bool", source, default=False)
        tokenizer_class = config.get("tokenizer_class")
        tokenizer_class = tokenizer_class.removesuffix("Fast") if isinstance(tokenizer_class, str) else None
        if tokenizer_class in CLASS_SPECIAL_TOKENS:
            self._set_post_processor(*CLASS_SPECIAL_TOKENS[tokenizer_class])
        elif self._tok.post_processor is None:
            self._set_post_processor(False, False)
        self._clean_up = clean_up and type(self._tok.model).__name__ != "BPE"
        self._space_marker = _metaspace_marker(self._tok)
        self.chat_template = chat_template
        # every template by name ("default" is chat_template); with tools, "tool_use" is rendered when there is one
        self.named_chat_templates: dict[str, str] = {} if chat_template is None else {"default": chat_template}
        self._compiled: dict = {}             # template text -> compiled template

    def _check_special_ids(self, model_vocab_size: int | None) -> None:
        # transformers appends a special token missing from tokenizer.json as a new id; past the model's
        # embeddings every prompt that contains it (bos: every prompt) would fail, so refuse at load time
        if model_vocab_size is None:
            return
        for key, token in self.special_tokens.items():
            token_id = self._tok.token_to_id(token)
            if token_id is not None and token_id >= model_vocab_size:
                raise ConfigError(
                    f"tokenizer_config.json: {key} {token!r} is not in tokenizer.json's vocabulary (it would get id "
                    f"{token_id}, but config.json's vocab_size is {model_vocab_size}); name a token the vocabulary "
                    "has, or add it to tokenizer.json")

    @property
    def backend(self):
        """The tokenizers.Tokenizer (the incremental detokenizer decodes windows of ids with it)."""
        return self._tok

    @property
    def cleans_up_spaces(self) -> bool:
        """Whether decode applies CLEANUPS (clean_up_tokenization_spaces, never for BPE)."""
        return self._clean_up

    @classmethod
    def from_folder(cls, folder: str) -> "Tokenizer":
        """Read tokenizer.json, tokenizer_config.json and chat_template.jinja from a model folder."""
        from tokenizers import Tokenizer as Backend
        path = os.path.join(folder, "tokenizer.json")
        try:
            backend = Backend.from_file(path)
        except Exception as exc:   # tokenizers raises a plain Exception for a malformed file
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"{path} could not be read ({first}); re-download it") from None
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        model_config = _read_json(os.path.join(folder, "config.json"))
        vocab_size = read_field(model_config, "vocab_size", "int", os.path.join(folder, "config.json"), minimum=1)
        backend, named = transformers_backend(folder, backend, model_config.get("model_type"),
                                              config.get("tokenizer_class"))
        # the special tokens the rebuilt class names where tokenizer_config.json names none (one it appended past
        # the model's embeddings stays unnamed: a prompt holding it is refused as out of vocabulary, as vLLM does)
        named = {k: v for k, v in named.items() if not config.get(k)
                 and (vocab_size is None or (backend.token_to_id(v) or 0) < vocab_size)}
        config = {**config, **named}
        templates = _chat_templates(folder, config)
        tokenizer = cls(backend, config, templates.get("default"), vocab_size)
        tokenizer.named_chat_templates = templates
        return tokenizer

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        from tokenizers import processors
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        specials = [(t, self._tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        self._tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special tokens (e.g. bos) added as the model's tokenizer config says.

        Through encode_batch, which releases the GIL while it works (encode holds it: a 1 MB prompt
        froze every other thread of the server for 1.5 s)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in CLEANUPS:
                text = text.replace(before, after)
        return text

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (vLLM's decoded_token, convert_ids_list_to_tokens): decoded alone,
        special tokens shown, with the leading spaces a Metaspace decoder strips from a lone token put back
        ('\u2581the' is ' the')."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        marker = self._space_marker
        if marker is None:
            return text
        piece = self._tok.id_to_token(token_id) or ""
        markers = len(piece) - len(piece.lstrip(marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def convert_ids_to_tokens(self, ids) -> list[str]:
        """The vocabulary entries of ids (byte-level pieces such as 'Ġthe', not decoded text), as transformers'."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def _token_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # transformers' names for what a vLLM script reads from LLM.get_tokenizer() (the defaults above stay kvfit's:
    # decode skips special tokens, apply_chat_template adds the generation prompt and returns text) -----------------
    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        tokens = [*self.special_tokens.values(), *self.extra_special_tokens]
        return sorted({i for i in (self._tok.token_to_id(t) for t in tokens) if i is not None})

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        """{"input_ids": ids} (a list of them for a list of texts), as a transformers tokenizer's call."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """The vocabulary pieces of text (transformers' tokenize: no special tokens unless asked)."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens))

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Each token's id; one not in the vocabulary is the unk token's (None without one), as transformers'."""
        unk = self._token_id("unk_token")
        if isinstance(tokens, str):
            found = self._tok.token_to_id(tokens)
            return unk if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            template_kwargs: dict | None = None, tokenize: bool = False,
                            tools: list | None = None, documents: list | None = None,
                            **variables) -> str | list[int]:
        """The prompt for a chat: its text, or (tokenize) its token ids as transformers'
        apply_chat_template(tokenize=True) gives them: the rendered text encoded WITHOUT adding
        special tokens, since the template writes its own (a `{{ bos_token }}` template gets one bos).

        chat_template: a template text to use instead of the model's; ConfigError when there is none.
        tools: OpenAI function tools for the template (transformers' tools=). Other keyword arguments are template
        variables, as transformers passes them (enable_thinking=False), with template_kwargs'."""
        source = chat_template if chat_template is not None else self.chat_template
        if chat_template is None and tools is not None and "tool_use" in self.named_chat_templates:
            source = self.named_chat_templates["tool_use"]      # transformers' and vLLM's choice with tools
        if source is None:
            raise ConfigError("this model has no chat_template in tokenizer_config.json or chat_template.jinja")
        unread = sorted(set(variables) & HF_CHAT_TEMPLATE_OPTIONS)
        if unread:
            raise RequestError(f"apply_chat_template({unread[0]}=...) is transformers' option, which kvfit's tokenizer "
                               "does not take: it returns the text, or the token ids with tokenize=True",
                               "apply_chat_template")
        if variables:
            template_kwargs = {**variables, **(template_kwargs or {})}
        text = render_chat_template(self.compiled_template(source), messages, add_generation_prompt,
                                    self.template_tokens, continue_final_message, template_kwargs, tools, source,
                                    documents)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def compiled_template(self, source: str):
        """The compiled template of a source text, compiled once (the model's and one override)."""
        if source not in self._compiled:
            if len(self._compiled) >= 4:
                self._compiled.clear()
            self._compiled[source] = compile_chat_template(source)
        return self._compiled[source]


def load_tokenizer(model_path: str) -> Tokenizer | None:
    """The folder's Tokenizer, or None when it has no tokenizer.json (dummy and catalog models)."""
    if not os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        return None
    return Tokenizer.from_folder(model_path)
