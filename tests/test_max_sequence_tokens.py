"""A model length past what int32 sequence lengths hold is a one-line error naming the flag to pass, never a plan
sized for it: config.json's max_position_embeddings taken by default, or --max-model-len; auto stays within it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvfit.errors import ConfigError
from kvfit.model_facts import load_model_facts
from kvfit.planning import MAX_SEQUENCE_TOKENS, resolve_max_model_len


@pytest.fixture
def huge_positions(tmp_path, tiny_llama):
    folder = tmp_path / "huge"
    folder.mkdir()
    with open(f"{tiny_llama}/config.json") as f:
        config = json.load(f)
    config["max_position_embeddings"] = 10**30
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_model_length_is_bounded_by_int32_sequence_lengths(huge_positions):
    facts = load_model_facts(huge_positions)
    with pytest.raises(ConfigError, match=r"max_position_embeddings 1000000000000000000000000000000 is longer than "
                                          r"the 2,147,483,647 tokens .* pass --max-model-len"):
        resolve_max_model_len(facts, None)
    assert resolve_max_model_len(facts, "auto") == MAX_SEQUENCE_TOKENS
    assert resolve_max_model_len(facts, 64) == 64
    with pytest.raises(ConfigError, match=r"^--max-model-len 2147483648 is longer than the 2,147,483,647 tokens"):
        resolve_max_model_len(facts, 2**31)


def test_kvfit_plan_refuses_it_in_one_line(huge_positions):
    done = subprocess.run([sys.executable, "-m", "kvfit.cli", "plan", huge_positions, "--device-memory", "80GiB"],
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "--max-model-len" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
