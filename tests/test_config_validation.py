"""Corrupt model folders and out-of-range flags through the real CLI: one `error:` line, exit 2, no traceback.

Each folder is a tiny model (tests/tiny_models.py) with one file edited; every case here used to end in a
traceback or in silently wrong output (issue 12).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvfit.cli import main
from kvfit.errors import ConfigError
from kvfit.model_facts import read_field
from tiny_models import make_tiny_model

GENERATE = ["--prompt", "hello", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--max-model-len", "64", "--max-tokens", "2", "--temperature", "0"]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", name="base")


def corrupt(base: str, tmp_path, file: str = "config.json", edit=None, text: str | None = None) -> str:
    """A copy of the base folder with `file` replaced by `text` or changed by edit(parsed json)."""
    folder = str(tmp_path / "corrupt")
    shutil.copytree(base, folder)
    path = os.path.join(folder, file)
    if text is None:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        edit(data)
        text = json.dumps(data)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return folder


def one_line_error(capsys, argv: list[str], status: int = 2) -> str:
    """Run the CLI; assert exit `status` (2: a user mistake; `kvfit plan`: 1 for a model that does not
    fit) and exactly one `error:` line on stderr; return that line."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == status, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _set(**fields):
    return lambda cfg: cfg.update(fields)


def _set_rope(**fields):
    return lambda cfg: cfg["rope_parameters"].update(fields)


# (case id, file, edit or text, words the error must contain): read by `kvfit plan`, which reads config.json only
CONFIG_CASES = [
    ("deeply-nested", "config.json", "[" * 100_000 + "]" * 100_000, ["config.json", "nested too deeply"]),
    ("huge-integer", "config.json", '{"hidden_size": ' + "9" * 5000 + "}", ["config.json", "not valid JSON"]),
    ("not-an-object", "config.json", "[1, 2]", ["config.json", "JSON object"]),
    ("quantization-config-list", "config.json", _set(quantization_config=[1]),
     ["config.json", "'quantization_config'", "JSON object", "[1]"]),
    ("quant-method-number", "config.json", _set(quantization_config={"quant_method": 8}),
     ["quantization_config", "'quant_method'", "string"]),
    ("eps-string", "config.json", _set(rms_norm_eps="small"), ["'rms_norm_eps'", "positive finite number", "'small'"]),
    ("eps-negative", "config.json", _set(rms_norm_eps=-1), ["'rms_norm_eps'", "positive finite number", "-1"]),
    ("eps-zero", "config.json", _set(rms_norm_eps=0), ["'rms_norm_eps'", "positive finite number"]),
    ("eps-nan", "config.json", _set(rms_norm_eps=float("nan")), ["'rms_norm_eps'", "got nan"]),
    ("tie-string", "config.json", _set(tie_word_embeddings="false"),
     ["config.json", "'tie_word_embeddings'", "JSON boolean", "'false'"]),
    ("attention-bias-int", "config.json", _set(attention_bias=1), ["'attention_bias'", "JSON boolean"]),
    ("architectures-dict", "config.json", _set(architectures=[{"a": 1}]), ["'architectures'"]),
    ("model-type-list", "config.json", _set(architectures=None, model_type=["llama"]), ["'model_type'", "string"]),
    ("dtype-number", "config.json", _set(dtype=16), ["'dtype'", "string"]),
    ("hidden-act-list", "config.json", _set(hidden_act=["silu"]), ["'hidden_act'", "string"]),
    ("head-dim-float", "config.json", _set(head_dim=16.5), ["'head_dim'", "positive integer"]),
]


@pytest.mark.parametrize("case,file,change,words", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_corrupt_config_is_one_line_error(base_model, tmp_path, capsys, case, file, change, words):
    folder = corrupt(base_model, tmp_path, file, **({"text": change} if isinstance(change, str) else {"edit": change}))
    for argv in (["plan", folder], ["generate", folder, *GENERATE]):
        line = one_line_error(capsys, argv)
        assert all(word in line for word in words), line


# read only when the model is built or its weights and tokenizer are loaded: through `kvfit generate`
LOAD_CASES = [
    ("rope-scaling-string", "config.json", _set(rope_scaling="llama3"), ["'rope_scaling'", "JSON object"]),
    ("rope-parameters-list", "config.json", _set(rope_parameters=[1]), ["'rope_parameters'", "JSON object"]),
    ("rope-theta-string", "config.json", _set_rope(rope_theta="big"), ["'rope_theta'", "positive", "'big'"]),
    # 0 used to become 10000 (a falsy default); a negative theta gave NaN logits
    ("rope-theta-zero", "config.json", _set_rope(rope_theta=0), ["'rope_theta'", "positive", "got 0"]),
    ("rope-theta-negative", "config.json", _set_rope(rope_theta=-5.0), ["'rope_theta'", "got -5.0"]),
    ("rope-factor-zero", "config.json", _set_rope(rope_type="linear", factor=0), ["'factor'", "positive", "got 0"]),
    ("rope-factor-missing", "config.json", _set_rope(rope_type="linear"), ["missing 'factor'"]),
    ("rope-llama3-bands", "config.json",
     _set_rope(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0,
               original_max_position_embeddings=64), ["high_freq_factor must be greater than low_freq_factor"]),
    ("rope-type-number", "config.json", _set_rope(rope_type=3), ["'rope_type'", "string"]),
    # transformers 5 layout: rope_parameters' theta wins, but a malformed top-level one used to be ignored
    ("rope-theta-top-level-shadowed", "config.json", _set(rope_theta="x"), ["'rope_theta'", "'x'"]),
    ("index-shard-number", "model.safetensors.index.json", '{"weight_map": {"lm_head.weight": 5}}',
     ["model.safetensors.index.json", "'weight_map'", "'lm_head.weight': 5"]),
    ("index-weight-map-list", "model.safetensors.index.json", '{"weight_map": [1]}', ["'weight_map'", "JSON object"]),
    ("index-not-object", "model.safetensors.index.json", "[]", ["model.safetensors.index.json", "JSON object"]),
    ("index-shard-outside", "model.safetensors.index.json", '{"weight_map": {"a": "../x.safetensors"}}',
     ["'weight_map'", "shard file names"]),
    ("generation-config-nested", "generation_config.json", "[" * 100_000 + "]" * 100_000,
     ["generation_config.json", "nested too deeply"]),
    ("generation-config-list", "generation_config.json", "[1]", ["generation_config.json", "JSON object"]),
    ("generation-eos-string", "generation_config.json", '{"eos_token_id": "2"}', ["'eos_token_id'", "token id"]),
    ("tokenizer-config-huge-int", "tokenizer_config.json", '{"model_max_length": ' + "9" * 5000 + "}",
     ["tokenizer_config.json", "not valid JSON"]),
    ("add-bos-string", "tokenizer_config.json", _set(add_bos_token="true"), ["'add_bos_token'", "JSON boolean"]),
    ("bos-token-number", "tokenizer_config.json", _set(bos_token=5), ["'bos_token'", "token string"]),
    ("chat-template-number", "tokenizer_config.json", _set(chat_template=5), ["'chat_template'"]),
    # transformers appends such a token as id 320 = vocab_size: every prompt (bos) failed at request time
    ("bos-not-in-vocab", "tokenizer_config.json", _set(bos_token="<bos_missing>"),
     ["tokenizer_config.json", "bos_token '<bos_missing>'", "not in tokenizer.json's vocabulary", "320"]),
    ("eos-not-in-vocab", "tokenizer_config.json", _set(eos_token={"content": "<end>", "special": True}),
     ["eos_token '<end>'"]),
]


@pytest.mark.parametrize("case,file,change,words", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_corrupt_model_folder_is_one_line_error(base_model, tmp_path, capsys, case, file, change, words):
    folder = corrupt(base_model, tmp_path, file, **({"text": change} if isinstance(change, str) else {"edit": change}))
    line = one_line_error(capsys, ["generate", folder, *GENERATE])
    assert all(word in line for word in words), line


def test_hidden_size_too_big_for_memory_is_weights_do_not_fit(base_model, tmp_path, capsys):
    # the largest sizes allowed: about 2.6e13 parameters, past any machine's memory
    folder = corrupt(base_model, tmp_path, edit=_set(hidden_size=2**20, intermediate_size=2**22, head_dim=16))
    line = one_line_error(capsys, ["generate", folder, *GENERATE])
    assert "the weights do not fit" in line and "cpu" in line, line
    assert "weights" in one_line_error(capsys, ["plan", folder], status=1)


@pytest.mark.parametrize("hidden_size", [2**40, 2**70], ids=["past-any-model", "past-int64"])
def test_hidden_size_past_any_model_is_a_config_error(base_model, tmp_path, capsys, hidden_size):
    folder = corrupt(base_model, tmp_path, edit=_set(hidden_size=hidden_size, head_dim=16))
    for argv in (["generate", folder, *GENERATE], ["plan", folder]):
        line = one_line_error(capsys, argv)
        assert "'hidden_size' must be an integer from 1 to 1,048,576" in line and str(hidden_size) in line, line


@pytest.mark.parametrize("argv,words", [
    (["plan", "llama-3.1-8b", "--device-memory", "1e400GB"], ["--device-memory", "too large"]),
    (["plan", "llama-3.1-8b", "--device-memory", "9" * 5000 + "B"], ["--device-memory", "too large"]),
    (["plan", "llama-3.1-8b", "--device-memory", "1e19B"], ["--device-memory", "too large"]),
    (["plan", "llama-3.1-8b", "--kv-cache-memory", "1e400TiB"], ["--kv-cache-memory", "too large"]),
], ids=["device-memory-1e400", "device-memory-5000-digits", "device-memory-past-int64", "kv-cache-memory-inf"])
def test_out_of_range_plan_flags(capsys, argv, words):
    line = one_line_error(capsys, argv)
    assert all(word in line for word in words), line


@pytest.mark.parametrize("seed", [str(2**64), "-1", "9" * 5000, "1.5"])
def test_seed_out_of_range_is_one_line_error(base_model, capsys, seed):
    with pytest.raises(SystemExit) as exit_info:   # argparse rejects it before anything is built
        main(["generate", base_model, *GENERATE, "--seed", seed])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: argument --seed") and "2**64" in err, err


@pytest.mark.parametrize("argv", [
    ["plan", "llama-3.1-8b", "--block-size", str(2**70)],
    ["plan", "llama-3.1-8b", "--max-num-seqs", "9" * 5000],
    ["generate", "x", "--top-k", str(2**70)],
    ["generate", "x", "--max-tokens", str(2**64)],
], ids=["block-size", "max-num-seqs-5000-digits", "top-k", "max-tokens"])
def test_integer_flags_must_fit_int64(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: argument {argv[2]}"), err


ROPE_CASES = [case for case in LOAD_CASES if case[0].startswith("rope-")]


@pytest.mark.parametrize("case,file,change,words", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_plan_and_generate_refuse_the_same_rope_configs(base_model, tmp_path, capsys, case, file, change, words):
    # issue 12: `kvfit plan` used to accept rope settings that `generate` refused (the check needed torch)
    folder = corrupt(base_model, tmp_path, file, edit=change)
    assert one_line_error(capsys, ["plan", folder]) == one_line_error(capsys, ["generate", folder, *GENERATE])


def test_largest_seed_runs(base_model, capsys):
    assert main(["generate", base_model, *GENERATE, "--seed", str(2**64 - 1), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "hello"


def test_null_rope_theta_and_eps_take_the_defaults(base_model, tmp_path, capsys):
    # null means "the default" in transformers; only explicit values are range-checked
    folder = corrupt(base_model, tmp_path, edit=lambda cfg: (cfg.update(rms_norm_eps=None),
                                                              cfg["rope_parameters"].update(rope_theta=None)))
    assert main(["generate", folder, *GENERATE, "--json"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("value,kind,kwargs,message", [
    (True, "int", {}, "'f' must be an integer, got True"),
    (float("inf"), "number", {}, "'f' must be a finite number, got inf"),
    (10**400, "number", {}, "'f' must be a finite number"),
    (0, "int", {"minimum": 1}, "'f' must be a positive integer, got 0"),
    (-1, "int", {"minimum": 0}, "'f' must be an integer >= 0, got -1"),
    (0.0, "number", {"above": 0}, "'f' must be a positive finite number, got 0.0"),
    ("x" * 500, "bool", {}, "got 'xxxxxxxx"),
])
def test_read_field_names_file_field_value_and_what_is_allowed(value, kind, kwargs, message):
    with pytest.raises(ConfigError, match="^f.json: ") as info:
        read_field({"f": value}, "f", kind, "f.json", **kwargs)
    assert message in str(info.value) and len(str(info.value)) < 200


def test_read_field_defaults_and_conversions():
    assert read_field({}, "f", "int", default=3) == 3
    assert read_field({"f": None}, "f", "bool", default=False) is False
    assert read_field({"f": 2}, "f", "number") == 2.0 and isinstance(read_field({"f": 2}, "f", "number"), float)
    with pytest.raises(ConfigError, match="missing 'f'"):
        read_field({}, "f", "int", required=True)
