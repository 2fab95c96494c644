"""`kvfit plan` when the model does not fit (exit 1, `"fits": false` and the reason with --json) and
`--max-model-len auto` (the longest request the KV cache holds, capped by the model's)."""

from __future__ import annotations

import json

import pytest

from kvfit.cli import main
from kvfit.errors import CapacityError
from kvfit.kv.plan import MemoryReading, PlanLimits, assess_kv_cache, plan_kv_cache
from kvfit.kv.spec import KVSpec

README_EXAMPLE = ["plan", "llama-3.1-70b", "--gpu", "H100-80GB", "--tensor-parallel-size", "2", "--json"]


def run(capsys, argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); argparse's refusals (SystemExit) count as statuses too."""
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_readme_example_prints_the_plan_that_does_not_fit(capsys):
    status, out, err = run(capsys, README_EXAMPLE)
    assert status == 1 and err == ""
    plan = json.loads(out)
    assert plan["fits"] is False and plan["max_model_len"] == 131072
    # the reason is the error the engine would give, with the largest length that fits
    assert "--max-model-len" in plan["reason"] and f"at most {plan['token_capacity']}" in plan["reason"]
    assert plan["num_blocks"] == plan["limits"]["memory"] > 0


def test_readme_example_with_auto_fits(capsys):
    status, out, _ = run(capsys, README_EXAMPLE + ["--max-model-len", "auto"])
    assert status == 0
    plan = json.loads(out)
    assert plan["fits"] is True and plan["reason"] is None
    # one request may use every block: the length is the token capacity, below the model's 131072
    assert plan["max_model_len"] == plan["token_capacity"] < plan["max_model_len_cap"] == 131072
    assert plan["max_concurrency"] == 1.0


def test_weights_that_do_not_fit_still_give_a_plan(capsys):
    status, out, _ = run(capsys, ["plan", "llama-3.1-70b", "--gpu", "RTX-4090", "--json"])
    plan = json.loads(out)
    assert status == 1 and plan["fits"] is False and "weights" in plan["reason"]
    assert plan["num_blocks"] == 0 and plan["reading"]["weights_bytes"] > plan["reading"]["budget_bytes"]


def test_without_json_it_is_one_error_line_and_exit_1(capsys):
    status, out, err = run(capsys, README_EXAMPLE[:-1])
    assert status == 1 and out == ""
    assert err.startswith("error: one request of --max-model-len 131072") and err.count("\n") == 1


def test_a_user_mistake_is_still_exit_2(capsys):
    status, _, err = run(capsys, ["plan", "llama-3.1-8b", "--block-size", "12", "--json"])
    assert status == 2 and err.startswith("error: ")


def test_auto_on_a_model_that_fits_keeps_the_models_length(capsys):
    status, out, _ = run(capsys, ["plan", "llama-3.1-8b", "--max-model-len", "auto"])
    assert status == 0
    assert "131,072 tokens (--max-model-len auto: the model's maximum 131072 fits)" in out


@pytest.mark.parametrize("flag,expected", [("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("4096", 4096),
                                           ("-1", None), ("AUTO", None)])
def test_max_model_len_spellings(capsys, flag, expected):
    status, out, _ = run(capsys, ["plan", "llama-3.1-8b", "--max-model-len", flag, "--json"])
    plan = json.loads(out)
    assert status == 0
    assert plan["max_model_len"] == (expected or 131072)
    assert plan["max_model_len_cap"] == (None if expected else 131072)


@pytest.mark.parametrize("flag", ["32x", "1.5K", "nan", "k", "0"])
def test_bad_max_model_len_is_one_line(capsys, flag):
    status, _, err = run(capsys, ["plan", "llama-3.1-8b", "--max-model-len", flag])
    assert status == 2 and err.startswith("error: ") and "max-model-len" in err and err.count("\n") == 1, err


# the pure function: tiny made-up byte counts
SPEC = KVSpec(num_layers=1, block_size=4, kv_heads_per_rank=1, head_dim=8, dtype="float32")


def reading(kv_bytes: int) -> MemoryReading:
    return MemoryReading(total_bytes=1 << 30, budget_bytes=1 << 30, kv_cache_memory_bytes=kv_bytes)


def test_auto_lowers_to_what_the_blocks_hold():
    plan = plan_kv_cache(reading(10 * SPEC.bytes_per_block), SPEC, PlanLimits(max_model_len=1000,
                                                                                max_model_len_auto=True))
    assert plan.num_blocks == 10 and plan.max_model_len == 40 and plan.max_model_len_cap == 1000
    assert "--max-model-len auto: 40" in plan.log_line() and "the model allows 1000" in plan.log_line()


def test_auto_never_raises_the_length_past_the_cap():
    plan = plan_kv_cache(reading(100 * SPEC.bytes_per_block), SPEC, PlanLimits(max_model_len=30,
                                                                                 max_model_len_auto=True))
    assert plan.max_model_len == 30 and plan.max_concurrency == round(100 / 8, 2)


def test_auto_follows_the_override_and_the_block_cap():
    limits = PlanLimits(max_model_len=1000, max_model_len_auto=True, num_gpu_blocks_override=7)
    assert plan_kv_cache(reading(100 * SPEC.bytes_per_block), SPEC, limits).max_model_len == 28
    limits = PlanLimits(max_model_len=1000, max_model_len_auto=True, max_num_blocks=3)
    assert plan_kv_cache(reading(100 * SPEC.bytes_per_block), SPEC, limits).max_model_len == 12


def test_assess_returns_what_plan_raises():
    limits = PlanLimits(max_model_len=1000)
    plan = assess_kv_cache(reading(10 * SPEC.bytes_per_block), SPEC, limits)
    assert not plan.fits and plan.num_blocks == 10
    with pytest.raises(CapacityError) as err:
        plan_kv_cache(reading(10 * SPEC.bytes_per_block), SPEC, limits)
    assert str(err.value) == plan.reason


def test_assess_an_override_that_does_not_fit():
    plan = assess_kv_cache(reading(10 * SPEC.bytes_per_block), SPEC,
                           PlanLimits(max_model_len=8, num_gpu_blocks_override=11))
    assert not plan.fits and "--num-gpu-blocks-override 11" in plan.reason


def test_generate_says_how_auto_chose_the_length(capsys, caplog, tiny_llama):
    caplog.set_level("INFO", logger="kvfit")
    status = main(["generate", tiny_llama, "--prompt-token-ids", "5,6,7", "--max-tokens", "2", "--device", "cpu",
                   "--dtype", "float32", "--num-gpu-blocks-override", "4", "--block-size", "16",
                   "--max-model-len", "auto", "--kv-cache-memory", "4MiB"])
    assert status == 0, capsys.readouterr().err
    line = next(r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage())
    assert "at 64 tokens (--max-model-len auto: 64, the longest request the KV cache holds; " \
           "the model allows 512)" in line, line
