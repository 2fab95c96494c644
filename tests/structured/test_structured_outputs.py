"""StructuredOutputs: random logits, masked, sampled and accepted, always give text the spec allows.

Three tokenizers trained here: byte-level BPE (tiny_models), sentencepiece-style BPE with byte pieces
(byte fallback), and a Metaspace Unigram (llguidance cannot read its decoder; kvfit hands it the
token bytes). vocab_size is the tokenizer's plus padding, so padded ids must never be sampled.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvfit.errors import ConfigError, RequestError
from kvfit.structured import StructuredOutputs, StructuredOutputsParams as Params
from kvfit.text.tokenizer import Tokenizer
from tiny_models import BOS, CORPUS, EOS, UNK, train_byte_fallback_tokenizer, train_tokenizer

PADDING = 13          # model rows past the tokenizer's vocabulary
EOS_ID = 2
JSON_LINES = ['{"name": "Ada", "age": 36, "color": "red", "tags": ["x", "yz"]}', '[1, 2.5, -3e2, true, false, null]',
              '{"a": {"b": [ ]}, "c": "d\\n\\"e\\""}', 'x=1,yy=22,zzz=333 a@b.com c@d.org 555-123-4567 (+1)']
LINES = CORPUS.splitlines() + JSON_LINES * 3
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["name", "color"], "additionalProperties": False}
REGEX = r"[a-z]{1,5}@[a-z]{1,4}\.(com|org)|\(?[0-9]{3}\)? ?[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral", "don't know"]
LARK = 'start: item ("," item)*\nitem: WORD "=" NUMBER\nWORD: /[a-z]{1,6}/\nNUMBER: /[0-9]{1,3}/\n'
LARK_TEXT = r"[a-z]{1,6}=[0-9]{1,3}(,[a-z]{1,6}=[0-9]{1,3})*"
GBNF = 'root ::= item ("," item)*\nitem ::= [a-z] [a-z]? "=" [0-9] [0-9]?\n'
GBNF_TEXT = r"[a-z]{1,2}=[0-9]{1,2}(,[a-z]{1,2}=[0-9]{1,2})*"
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


def _byte_fallback():
    return train_byte_fallback_tokenizer(LINES)


def _metaspace():
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    tok = Backend(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(LINES, trainers.UnigramTrainer(vocab_size=300, special_tokens=[UNK, BOS, EOS],
                                                           unk_token=UNK, show_progress=False))
    return tok


BUILDERS = {"byte_level": lambda: train_tokenizer(), "byte_fallback": _byte_fallback, "metaspace": _metaspace}


@pytest.fixture(scope="module")
def outputs() -> dict[str, tuple[StructuredOutputs, Tokenizer]]:
    built = {}
    for name, build in BUILDERS.items():
        tok = Tokenizer(build(), {"eos_token": EOS, "bos_token": BOS, "unk_token": UNK})
        assert tok.eos_token_id == EOS_ID
        built[name] = StructuredOutputs(tok, tok.vocab_size + PADDING), tok
    return built


def generate(so: StructuredOutputs, tok: Tokenizer, spec, seed: int, max_tokens: int = 1500,
             stop_token_ids=()) -> str:
    """Random logits (EOS nudged up, as a model that wants to stop), masked, sampled, accepted."""
    matcher, bitmask = so.matcher(spec, stop_token_ids), so.allocate_bitmask(1)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        logits = 2 * torch.randn(1, so.vocab_size, generator=gen)   # [1, vocab]
        logits[0, EOS_ID] += 3
        matcher.fill(bitmask, 0)
        so.apply_bitmask(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert token < tok.vocab_size, f"padded id {token} sampled"
        assert matcher.accept(token), matcher.error
        if matcher.is_terminated():
            anchor = tok.encode("a", add_special_tokens=False)   # decode as a continuation (keeps a leading space)
            return tok.decode(anchor + out)[len(tok.decode(anchor)):]
        out.append(token)
    raise AssertionError(f"no end after {max_tokens} tokens: {tok.decode(out)[:200]!r}")


def _check_schema_object(text: str, compact: bool) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and {"name", "color"} <= value.keys() <= SCHEMA["properties"].keys(), text
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, text
    assert value["color"] in ("red", "green", "blue"), text
    if "age" in value:
        assert type(value["age"]) is int and 0 <= value["age"] <= 120, text
    if "tags" in value:
        assert len(value["tags"]) <= 2 and all(isinstance(t, str) and len(t) <= 3 for t in value["tags"]), text
    if compact:
        assert not re.search(r"\s", STRINGS.sub('""', text)), text


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("seed", range(3))
class TestOutputFollowsTheSpec:
    def test_json_schema(self, outputs, name, seed):
        _check_schema_object(generate(*outputs[name], Params(json=SCHEMA), seed), compact=False)

    def test_json_schema_without_whitespace(self, outputs, name, seed):
        spec = Params(json=json.dumps(SCHEMA), disable_any_whitespace=True)
        _check_schema_object(generate(*outputs[name], spec, seed), compact=True)

    def test_json_object(self, outputs, name, seed):
        text = generate(*outputs[name], Params(json_object=True, whitespace_pattern=r"[ ]?"), seed)
        assert isinstance(json.loads(text), dict), text

    def test_regex(self, outputs, name, seed):
        text = generate(*outputs[name], Params(regex=REGEX), seed)
        assert re.fullmatch(REGEX, text), text

    def test_choice(self, outputs, name, seed):
        assert generate(*outputs[name], Params(choice=CHOICES), seed) in CHOICES

    def test_lark_grammar(self, outputs, name, seed):
        text = generate(*outputs[name], Params(grammar=LARK), seed)
        assert re.fullmatch(LARK_TEXT, text), text

    def test_gbnf_grammar(self, outputs, name, seed):
        text = generate(*outputs[name], Params(grammar=GBNF), seed)
        assert re.fullmatch(GBNF_TEXT, text), text


POINTS = {"$defs": {"point": {"type": "object", "properties": {
    "x": {"type": "integer", "minimum": -9, "maximum": 9},
    "y": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
    "required": ["x", "y"], "additionalProperties": False}},
    "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3}


@pytest.mark.parametrize("seed", range(3))
def test_refs_and_any_of_are_followed(outputs, seed):
    points = json.loads(generate(*outputs["byte_fallback"], Params(json=POINTS, disable_any_whitespace=True), seed))
    assert 1 <= len(points) <= 3
    for point in points:
        assert point.keys() == {"x", "y"} and type(point["x"]) is int and -9 <= point["x"] <= 9, points
        assert point["y"] is None or (type(point["y"]) is int and 0 <= point["y"] <= 9), points


def test_json_whitespace_is_flexible_unless_disabled(outputs):
    outside = [STRINGS.sub('""', generate(*outputs["byte_level"], Params(json=SCHEMA), seed)) for seed in range(3)]
    assert any(re.search(r"\s", text) for text in outside), outside     # vLLM's default: any whitespace


def test_disable_additional_properties_closes_objects(outputs):
    so, tok = outputs["byte_level"]
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"]}
    for seed in range(3):
        assert json.loads(generate(so, tok, Params(json=open_schema, disable_additional_properties=True,
                                              disable_any_whitespace=True), seed)).keys() == {"a"}


@pytest.mark.parametrize("kwargs, words", [
    (dict(regex="a(b"), ["structured_outputs.regex", "unclosed group"]),
    (dict(grammar="start: foo"), ["structured_outputs.grammar", 'unknown name: "foo"']),
    (dict(grammar="root ::= [a-"), ["structured_outputs.grammar", "GBNF"]),
    (dict(json={"type": "frob"}), ["structured_outputs.json", "frob"]),
    # a keyword llguidance cannot enforce is refused, never silently ignored
    (dict(json={"type": "array", "uniqueItems": True}), ["structured_outputs.json", "uniqueItems"]),
    (dict(json={"$ref": "#/$defs/missing"}), ["structured_outputs.json", "missing"]),
    (dict(json_object=True, whitespace_pattern="("), ["structured_outputs.json_object", "unclosed group"]),
])
def test_refused_specs_give_one_line_request_errors(outputs, kwargs, words):
    so, _ = outputs["byte_level"]
    for _ in range(2):          # a refused spec is not cached: the second try is refused the same way
        with pytest.raises(RequestError) as info:
            so.compile(Params(**kwargs))
        assert info.value.param == "structured_outputs" and "\n" not in str(info.value)
        for word in words:
            assert word in str(info.value), str(info.value)


def test_compile_cache_returns_the_same_grammar_and_evicts_least_recent(outputs):
    tok = outputs["byte_level"][1]
    sizing = StructuredOutputs(tok, tok.vocab_size)
    num_bytes = [sizing.compile(Params(json=SCHEMA, disable_any_whitespace=flag)).num_bytes for flag in (False, True)]
    assert sizing.compile(Params(regex="[0-9]")).num_bytes <= num_bytes[1]
    so = StructuredOutputs(tok, tok.vocab_size, cache_bytes=sum(num_bytes))    # room for the two schemas
    first = so.compile(Params(json=SCHEMA))
    assert so.compile(Params(json=json.dumps(SCHEMA))) is first
    assert so.compile(Params(json=SCHEMA, disable_any_whitespace=True)) is not first
    assert so.compile(Params(json=SCHEMA)) is first        # now the most recent of the two
    so.compile(Params(regex="[0-9]"))                       # evicts the whitespace-free one, not `first`
    assert so.num_cached_bytes <= so.cache_bytes
    assert so.compile(Params(json=SCHEMA)) is first
    assert so.matcher(first).accept(tok.encode("{", add_special_tokens=False)[0])


def test_concurrent_compiles_build_each_spec_once(outputs, monkeypatch):
    tok = outputs["byte_level"][1]
    so = StructuredOutputs(tok, tok.vocab_size + PADDING)
    builds, build = [], so._build
    gate = threading.Barrier(8)

    def counting_build(spec):
        builds.append(spec.key)
        return build(spec)
    monkeypatch.setattr(so, "_build", counting_build)
    specs = [Params(json=SCHEMA), Params(regex=REGEX), Params(choice=CHOICES), Params(grammar=LARK)]

    def compile_all(worker):
        gate.wait()
        return [so.compile(specs[(worker + i) % len(specs)]) for i in range(len(specs) * 3)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(compile_all, range(8)))
    assert sorted(builds) == sorted(s.key for s in specs)
    by_key = {}
    for compiled in (c for worker in results for c in worker):
        assert by_key.setdefault(compiled.spec.key, compiled) is compiled
    for spec in specs[1:]:       # matchers copied from the shared grammars still work
        generate(so, tok, spec, seed=0)


def _allowed(so: StructuredOutputs, matcher) -> set[int]:
    bitmask = so.allocate_bitmask(2)
    matcher.fill(bitmask, 1)
    assert (bitmask[0] == -1).all()                         # other rows untouched
    bits = (bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.view(-1).nonzero().view(-1).tolist())


@pytest.mark.parametrize("name", BUILDERS)
def test_padded_ids_are_never_allowed(outputs, name):
    so, tok = outputs[name]
    num_tokens = tok.vocab_size
    for spec in (Params(json_object=True), Params(regex="(.|\n)*"), Params(grammar="start: /(.|\\n)+/")):
        matcher = so.matcher(spec)
        allowed = _allowed(so, matcher)
        assert allowed and max(allowed) < num_tokens
        assert not matcher.accept(num_tokens + 1) and not matcher.accept(so.vocab_size + 5)
    logits = torch.zeros(2, so.vocab_size + 40)             # logits wider than the mask: the excess is masked
    so.apply_bitmask(logits, so.allocate_bitmask(2))
    assert torch.isinf(logits[:, so.vocab_size:]).all() and not torch.isinf(logits[:, :so.vocab_size]).any()


def test_eos_is_allowed_only_where_the_grammar_may_end(outputs):
    so, tok = outputs["byte_level"]
    digits = so.matcher(Params(regex="[0-9]+"))
    assert EOS_ID not in _allowed(so, digits)
    assert digits.accept(tok.encode("7", add_special_tokens=False)[0])
    allowed = _allowed(so, digits)
    assert EOS_ID in allowed and len(allowed) > 1 and not digits.is_terminated()
    choice = so.matcher(Params(choice=["yes"]))
    for token in tok.encode("yes", add_special_tokens=False):
        assert choice.accept(token)
    assert _allowed(so, choice) == {EOS_ID}                 # complete: only EOS
    assert choice.accept(EOS_ID) and choice.is_terminated()
    assert _allowed(so, choice) == {EOS_ID} and not choice.accept(EOS_ID)


def test_request_stop_ids_end_the_output_like_eos(outputs):
    so, tok = outputs["byte_level"]
    stop = tok.encode("!", add_special_tokens=False)[0]
    matcher = so.matcher(Params(choice=["yes"]), stop_token_ids=[stop])
    assert stop not in _allowed(so, matcher) and not so.matcher(Params(choice=["yes"]), [stop]).accept(stop)
    for token in tok.encode("yes", add_special_tokens=False):
        matcher.accept(token)
    assert _allowed(so, matcher) == {EOS_ID, stop}
    assert matcher.accept(stop) and matcher.is_terminated()


def test_several_eos_ids(outputs):
    tok = outputs["byte_level"][1]
    so = StructuredOutputs(tok, tok.vocab_size, eos_token_ids=[EOS_ID, 1])
    matcher = so.matcher(Params(choice=["yes"]))
    for token in tok.encode("yes", add_special_tokens=False):
        matcher.accept(token)
    assert _allowed(so, matcher) == {EOS_ID, 1}
    assert matcher.accept(1) and matcher.is_terminated()


def test_a_rejected_token_leaves_the_matcher_in_error_with_only_eos_allowed(outputs):
    so, tok = outputs["byte_level"]
    matcher = so.matcher(Params(regex="[0-9]+"))
    assert not matcher.accept(tok.encode("x", add_special_tokens=False)[0])
    assert matcher.error and "\n" not in matcher.error and not matcher.is_terminated()
    assert _allowed(so, matcher) == {EOS_ID}


def test_batch_fill_equals_one_row_at_a_time(outputs):
    so, tok = outputs["byte_level"]
    stop = tok.encode("!", add_special_tokens=False)[-1]
    specs = [Params(json=SCHEMA), Params(regex=REGEX), Params(choice=CHOICES), Params(grammar=GBNF)]
    matchers = [so.matcher(s, stop_token_ids=[stop]) for s in specs]
    for matcher, prefix in zip(matchers, ['{"name"', "abc@", "neg", "a=1"]):
        for token in tok.encode(prefix, add_special_tokens=False):
            assert matcher.accept(token)
    rows = [5, 0, 3, 1]
    batch, single = so.allocate_bitmask(6), so.allocate_bitmask(6)
    so.fill_bitmask(batch, list(zip(matchers, rows)))
    for matcher, row in zip(matchers, rows):
        matcher.fill(single, row)
    assert torch.equal(batch, single)
    assert (batch[[2, 4]] == -1).all()


def _reference_apply(logits, bitmask, rows):
    out = logits.clone()
    for r in rows:
        for t in range(out.shape[1]):
            word, bit = divmod(t, 32)
            if word >= bitmask.shape[1] or not (int(bitmask[r, word]) >> bit) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_apply_bitmask_matches_a_bit_by_bit_reference(device):
    gen = torch.Generator().manual_seed(0)
    vocab = 100                                               # not a multiple of 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(4, vocab, generator=gen)
    for rows in (None, [2, 0], []):
        got = logits.to(device)
        from kvfit.structured import apply_bitmask
        apply_bitmask(got, bitmask, rows)
        expected = _reference_apply(logits, bitmask, range(4) if rows is None else rows)
        assert torch.equal(got.cpu(), expected)


def test_tokenizers_it_cannot_serve_are_config_errors(outputs):
    tok = outputs["byte_level"][1]
    with pytest.raises(ConfigError, match="vocab_size is 100"):
        StructuredOutputs(tok, 100).compile(Params(regex="a"))
    no_eos = Tokenizer(train_tokenizer(), {"bos_token": BOS})
    with pytest.raises(ConfigError, match="eos_token"):
        StructuredOutputs(no_eos, no_eos.vocab_size).compile(Params(regex="a"))
