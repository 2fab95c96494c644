"""generation_config.json: the EOS ids (the file's, else config.json's, else none) and a bad id's error."""

from __future__ import annotations

import json

import pytest

from kvfit.errors import ConfigError
from kvfit.model_facts import facts_from_config, load_model_facts
from kvfit.text.generation_config import load_generation_eos


def test_generation_eos(tiny_llama, tmp_path):
    facts = load_model_facts(tiny_llama)
    assert load_generation_eos(tiny_llama, facts) == [2]
    assert load_generation_eos(None, facts) == [2]              # config.json's eos_token_id
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_generation_eos(str(tmp_path), facts) == [2, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match="eos_token_id"):
        load_generation_eos(str(tmp_path), facts)
    no_eos = facts_from_config({k: v for k, v in facts.raw.items() if k != "eos_token_id"})
    assert load_generation_eos(None, no_eos) == []
