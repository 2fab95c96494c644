"""Adversarial review of the text path against transformers' AutoTokenizer (ids, decoded text) and vLLM 0.26's
output rules (stop strings, min_tokens, spaces_between_special_tokens).

Tokenizers of every `tokenizers` model kind, saved as a test would save them (PreTrainedTokenizerFast(
tokenizer_object=...).save_pretrained: tokenizer_class "TokenizersBackend") beside a transformers config:
- bytelevel: GPT-2 style byte-level BPE
- llama2: BPE + byte_fallback, Llama-2's tokenizer.json pipeline (Prepend/Replace normalizer, Replace/ByteFallback/
  Fuse/Strip decoder)
- metaspace_bf: BPE + byte_fallback with a Metaspace pre-tokenizer and ByteFallback + Metaspace decoder
- unigram: NFKC + collapsing spaces, Metaspace
- wordpiece: BERT normalizer (lowercase), BertPreTokenizer, WordPiece decoder
- wordlevel: Whitespace pre-tokenizer, no decoder (" ".join)
each with added tokens ("<tool>", " hello world") and special ones ("<|im_end|>", "<|im_start|>"), bos post-processor.

Each test once exposed a defect the review found (qwen2 folders, special-token flags, min_tokens stops,
spaces_between_special_tokens, logprob token texts); they pin the fixes.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

from kvfit.text.detokenizer import IncrementalDetokenizer
from kvfit.text.tokenizer import Tokenizer
from tiny_models import CORPUS

TEXT = CORPUS + """\
Emoji 🙂🚀👍🏽 and accents: café naïve Ångström crème brûlée. Ελληνικά και русский текст.
CJK: 東京は晴れ。日本語のテキスト、中文文本。한국어 텍스트.
Don't stop ! ok . what ? it 's fine , we 're here and they 've gone ; x ' y n't
"""
LINES = TEXT.splitlines() * 4
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
TRICKY = ["", " ", "  ", "   leading", "trailing   ", "a  b   c", "\n", "\n\nx\n", "\t tab\t", "\r\n crlf",
          "Hello world", " Hello", "café naïve", "e\u0301 combining a\u0308", "🙂🚀👍🏽 emoji", "東京は晴れ。中文", "한국어",
          "x<s>y</s>z", "<s>", "</s>", " <s> ", "<tool>", "a<tool>b", " <tool> ", "<|im_start|>user\nhi<|im_end|>\n",
          "hello world", " hello world", "hello  world", "ﬁ ligature ①", "Don't stop ! ok . what ?",
          "\u00a0nbsp\u3000ideo", "x" * 50, "The year 2024, isn't it?"]


# tokenizers ---------------------------------------------------------------------------------------
def _with_byte_pieces(tok, fuse_unk: bool = False):
    from tokenizers import Tokenizer as Backend
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    state["model"]["byte_fallback"] = True
    state["model"]["fuse_unk"] = fuse_unk
    return Backend.from_str(json.dumps(state))


def _bytelevel():
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _llama2():
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers, trainers
    tok = Backend(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=350, special_tokens=SPECIALS, show_progress=False))
    tok = _with_byte_pieces(tok, fuse_unk=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _metaspace_bf():
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    tok = Backend(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=350, special_tokens=SPECIALS, show_progress=False))
    tok = _with_byte_pieces(tok)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
    return tok


def _unigram():
    from tokenizers import Regex, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Backend(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(LINES, trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIALS, unk_token="<unk>",
                                                           show_progress=False))
    return tok


def _wordpiece():
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Backend(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(LINES, trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                             show_progress=False))
    return tok


def _wordlevel():
    from tokenizers import Tokenizer as Backend, models, pre_tokenizers, trainers
    tok = Backend(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                             show_progress=False))
    return tok


KINDS = {"bytelevel": _bytelevel, "llama2": _llama2, "metaspace_bf": _metaspace_bf, "unigram": _unigram,
         "wordpiece": _wordpiece, "wordlevel": _wordlevel}


def _decorate(tok, clean_up: bool | None = None, **special_tokens):
    """Added and special tokens, a bos post-processor; a PreTrainedTokenizerFast of it."""
    import transformers
    from tokenizers import processors
    tok.add_tokens(["<tool>", " hello world"])
    tok.add_special_tokens(["<|im_end|>", "<|im_start|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    kwargs = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    kwargs.update(special_tokens)
    if clean_up is not None:
        kwargs["clean_up_tokenization_spaces"] = clean_up
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def _save(folder, hf_tok, config_class: str = "LlamaConfig", weights: bool = False) -> str:
    """hf_tok saved with a tiny config (and random weights when asked) of config_class."""
    import torch
    import transformers
    os.makedirs(folder, exist_ok=True)
    hf_tok.save_pretrained(folder)
    config = getattr(transformers, config_class)(
        vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id)
    if not weights:
        config.save_pretrained(folder)
        return str(folder)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("detok-review")
    return {kind: _save(root / kind, _decorate(build())) for kind, build in KINDS.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Tiny random-weight llamas (std 0.3: they emit arbitrary ids) of four tokenizer kinds."""
    root = tmp_path_factory.mktemp("detok-review-models")
    return {kind: _save(root / kind, _decorate(KINDS[kind]()), weights=True)
            for kind in ("bytelevel", "llama2", "wordpiece", "metaspace_bf")}


def _hf(folder):
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(folder)


def _random_ids(rng, tok: Tokenizer, max_len: int = 24) -> list[int]:
    """Arbitrary ids, weighted towards added/special tokens and byte pieces (what random weights emit)."""
    added = sorted(tok.backend.get_added_tokens_decoder())
    byte_ids = [i for i in range(tok.vocab_size) if (tok.backend.id_to_token(i) or "").startswith("<0x")]
    ids = []
    for _ in range(rng.randint(0, max_len)):
        r = rng.random()
        ids.append(rng.choice(added) if r < 0.15 else rng.choice(byte_ids) if r < 0.4 and byte_ids
                   else rng.randrange(tok.vocab_size))
    return ids


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> tuple[str, str]:
    detok = IncrementalDetokenizer(tok, (), skip)
    deltas = []
    for token_id in ids:
        detok.add(token_id)
        deltas.append(detok.new_text())
    final = detok.final_text()
    deltas.append(detok.new_text())
    return final, "".join(deltas)


# passing: ids and text equal AutoTokenizer's for every tokenizer kind -----------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_prompt_ids_equal_autotokenizer_on_tricky_texts(folders, kind):
    hf, ours = _hf(folders[kind]), Tokenizer.from_folder(folders[kind])
    assert ours.vocab_size == len(hf)
    for text in TRICKY:
        for special in (True, False):
            assert ours.encode(text, special) == hf(text, add_special_tokens=special)["input_ids"], (text, special)
    assert ours.eos_token_id == hf.eos_token_id and ours.bos_token_id == hf.bos_token_id


@pytest.mark.parametrize("kind", list(KINDS))
def test_decoded_and_streamed_text_equal_autotokenizer_decode(folders, kind):
    """Random ids (split UTF-8, byte pieces, special and added tokens mid-stream), both skip_special_tokens."""
    hf, ours = _hf(folders[kind]), Tokenizer.from_folder(folders[kind])
    rng = random.Random(0)
    for _ in range(120):
        ids = _random_ids(rng, ours)
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip) == expected, (ids, skip)
            assert _stream(ours, ids, skip) == (expected, expected), (ids, skip)


@pytest.mark.parametrize("kind", ["bytelevel", "llama2", "wordpiece"])
def test_generate_text_equals_decode_of_the_output_ids(models, kind):
    from kvfit import LLM, SamplingParams
    hf = _hf(models[kind])
    llm = LLM(models[kind], device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    try:
        prompts = ["Hello world", " 🙂 東京", "a<tool>b</s><s>"]
        for skip in (True, False):
            params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, n=2, skip_special_tokens=skip)
            for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
                assert list(out.prompt_token_ids) == hf(prompt)["input_ids"]
                for sample in out.outputs:
                    ids = list(sample.token_ids)
                    # vLLM: a final eos is in token_ids but its text is left out
                    shown = ids[:-1] if sample.finish_reason == "stop" else ids
                    assert sample.text == hf.decode(shown, skip_special_tokens=skip), (ids, skip)
    finally:
        llm.shutdown()


def test_server_stream_equals_full_text(models):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))
    import httpx
    from server_testing import make_engine, running_server
    folder = models["llama2"]
    hf = _hf(folder)

    def complete(url, stream, **body):
        body = dict(model="tiny", prompt=" 🙂 東京", max_tokens=30, temperature=1.0, seed=7, n=2,
                    return_token_ids=True, **body)
        if not stream:
            choices = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
            return {c["index"]: (c["text"], c["finish_reason"], c["token_ids"]) for c in choices}
        out: dict[int, list] = {}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        text, reason, ids = out.setdefault(c["index"], ["", None, []])
                        out[c["index"]] = [text + c["text"], c["finish_reason"] or reason, ids + (c["token_ids"] or [])]
        return {i: tuple(v) for i, v in out.items()}

    engine = make_engine(folder)
    try:
        with running_server(engine, "tiny") as (url, _):
            for extra in ({}, {"skip_special_tokens": False}, {"stop": [" ", "e"]},
                          {"stop": ["o", "\n"], "include_stop_str_in_output": True}):
                full, streamed = complete(url, False, **extra), complete(url, True, **extra)
                assert full == streamed, extra
                if not extra.get("stop"):
                    for text, reason, ids in full.values():
                        shown = ids[:-1] if reason == "stop" else ids
                        assert text == hf.decode(shown, skip_special_tokens=extra.get("skip_special_tokens", True))
    finally:
        engine.shutdown()


# defects --------------------------------------------------------------------------------------
def test_qwen2_folder_ids_equal_autotokenizer(tmp_path):
    folder = _save(tmp_path / "qwen2", _decorate(_bytelevel()), config_class="Qwen2Config")
    hf, ours = _hf(folder), Tokenizer.from_folder(folder)
    for text in ("The year 2024, isn't it?", "e\u0301", "<|endoftext|>"):
        assert ours.encode(text) == hf(text)["input_ids"], text


def test_named_special_token_added_as_plain_token_is_skipped(tmp_path):
    from tokenizers import Tokenizer as Backend, decoders, models as tok_models, pre_tokenizers
    import transformers
    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    tok = Backend(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_tokens(["<s>", "</s>"])                     # plain added tokens (special=False in tokenizer.json)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>")
    folder = str(tmp_path / "plain-specials")
    hf_tok.save_pretrained(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump({"model_type": "llama", "vocab_size": len(hf_tok)}, fh)
    hf, ours = _hf(folder), Tokenizer.from_folder(folder)
    ids = hf.convert_tokens_to_ids(["<s>", "hello", "</s>", "world"])
    assert hf.decode(ids, skip_special_tokens=True) == "hello world"
    assert ours.decode(ids) == "hello world"
    assert _stream(ours, ids, True)[0] == "hello world"


def test_mask_token_missing_from_tokenizer_json_gets_an_id(tmp_path):
    folder = _save(tmp_path / "mask", _decorate(_wordpiece(), mask_token="[MASK]", cls_token="[CLS]",
                                                sep_token="[SEP]"))
    with open(os.path.join(folder, "tokenizer.json")) as fh:   # save_pretrained wrote them in: take them out
        state = json.load(fh)
    state["added_tokens"] = [t for t in state["added_tokens"] if t["content"] not in ("[MASK]", "[CLS]", "[SEP]")]
    with open(os.path.join(folder, "tokenizer.json"), "w") as fh:
        json.dump(state, fh)
    hf, ours = _hf(folder), Tokenizer.from_folder(folder)
    assert ours.encode("a [MASK] b", False) == hf("a [MASK] b", add_special_tokens=False)["input_ids"]


def test_added_tokens_decoder_special_flag_is_honoured(tmp_path):
    folder = _save(tmp_path / "atd", _decorate(_bytelevel()))
    ours0 = Tokenizer.from_folder(folder)
    tool = ours0.backend.token_to_id("<tool>")
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as fh:
        config = json.load(fh)
    config["added_tokens_decoder"] = {str(tool): {"content": "<tool>", "special": True, "lstrip": False,
                                                  "rstrip": False, "normalized": False, "single_word": False}}
    with open(path, "w") as fh:
        json.dump(config, fh)
    hf, ours = _hf(folder), Tokenizer.from_folder(folder)
    ids = ours.encode("hi<tool>there", False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def _tiny_llm(folder: str):
    from kvfit import LLM
    return LLM(folder, device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=64)


def test_stop_string_inside_min_tokens_text_is_not_matched_later(models):
    from kvfit import SamplingParams
    folder = models["bytelevel"]
    hf = _hf(folder)
    x, newline = hf.convert_tokens_to_ids(["x", "Ċ"])
    llm = _tiny_llm(folder)
    try:
        for seed in range(200):     # a seeded run whose only "\n" is among its first 3 tokens
            free = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, allowed_token_ids=[x, newline])
            sample = llm.generate(["Hi"], free, use_tqdm=False)[0].outputs[0]
            if newline in sample.token_ids[:3] and newline not in sample.token_ids[3:]:
                break
        else:
            pytest.skip("no seed gives the pattern")
        stopped = llm.generate(["Hi"], SamplingParams(temperature=1.0, seed=seed, max_tokens=8, min_tokens=3,
                                                      allowed_token_ids=[x, newline], stop=["\n", "zzzz"]),
                               use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    # vLLM: "\n" came before min_tokens, never after: no stop string matches, the whole text stays
    assert (stopped.text, stopped.finish_reason) == (sample.text, "length")


def test_min_tokens_stop_repro_at_the_detokenizer():
    """The same defect without a model: ids of "a\nbc" one char each, min_tokens=2, stops ("\n", "zzzz"); the
    output processor adds each token with check_stop = num_output_tokens > min_tokens."""
    from tiny_models import train_tokenizer
    tok = Tokenizer(train_tokenizer(add_bos=False), {"eos_token": "</s>", "unk_token": "<unk>"})
    ids = tok.encode("a\nbc", add_special_tokens=False)
    assert tok.decode(ids) == "a\nbc" and len(ids) == 4
    detok = IncrementalDetokenizer(tok, ("\n", "zzzz"))
    matched = None
    for i, token_id in enumerate(ids):
        matched = detok.add(token_id, check_stop=i + 1 > 2)
        if matched:
            break
    assert (matched, detok.final_text()) == (None, "a\nbc")     # kvfit: ("\n", "a") at the third token


def test_spaces_between_special_tokens_false(models):
    from kvfit import SamplingParams
    folder = models["wordpiece"]
    hf = _hf(folder)
    tool, im_start = hf.convert_tokens_to_ids(["<tool>", "<|im_start|>"])
    llm = _tiny_llm(folder)
    try:
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=6, allowed_token_ids=[tool, im_start],
                                skip_special_tokens=False, spaces_between_special_tokens=False)
        sample = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert len(sample.token_ids) == 6
    # vLLM's FastIncrementalDetokenizer: an added token right after an added token is its bare content
    assert sample.text.strip() == "".join(hf.convert_ids_to_tokens(list(sample.token_ids))), sample.text


def test_logprob_decoded_token_keeps_the_metaspace_leading_space(models):
    from kvfit import SamplingParams
    folder = models["metaspace_bf"]
    hf = _hf(folder)
    the = hf.convert_tokens_to_ids("\u2581the")
    llm = _tiny_llm(folder)
    try:
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=2, allowed_token_ids=[the], logprobs=0)
        sample = llm.generate(["fox"], params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert list(sample.token_ids) == [the, the] and sample.text == hf.decode([the, the]) == "the the"
    assert [position[the].decoded_token for position in sample.logprobs] == [" the", " the"]
