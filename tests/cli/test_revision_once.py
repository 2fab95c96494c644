"""Issue 29: a Hugging Face id at --revision loads THAT revision's snapshot, in LLM(...) and in `kvfit generate`
(the name is resolved once, by the config). The fake cache's v1 snapshot differs from main's in its
generation_config.json (max_new_tokens), which sets how many tokens `kvfit generate` makes by default."""

from __future__ import annotations

import json

from test_cli_hub import MAIN_HASH, V1_HASH, add_to_cache

from kvfit.cli import main

MAIN_TOKENS, V1_TOKENS = 5, 2


def _cache(tmp_path, monkeypatch, folder):
    root = tmp_path / "hub"
    snapshots = add_to_cache(root, "org/tiny", folder, {"main": MAIN_HASH, "v1": V1_HASH})
    for ref, tokens in (("main", MAIN_TOKENS), ("v1", V1_TOKENS)):
        path = snapshots[ref] / "generation_config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "max_new_tokens": tokens}))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.chdir(tmp_path)
    return snapshots


def test_llm_and_generate_load_the_revisions_snapshot(tmp_path, monkeypatch, tiny_llama, capsys):
    snapshots = _cache(tmp_path, monkeypatch, tiny_llama)
    from kvfit import LLM
    llm = LLM("org/tiny", revision="v1", device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=64,
              max_num_batched_tokens=64, max_num_seqs=4)
    try:
        assert llm.config.model.model == str(snapshots["v1"])
        assert llm.get_default_sampling_params().max_tokens == V1_TOKENS
    finally:
        llm.shutdown()
    for revision, tokens in (("v1", V1_TOKENS), (None, MAIN_TOKENS)):
        flags = ["--revision", revision] if revision else []
        assert main(["generate", "org/tiny", *flags, "--prompt-token-ids", "5,6", "--ignore-eos", "--json",
                     "--temperature", "0", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
                     "--max-model-len", "64", "--max-num-batched-tokens", "64", "--max-num-seqs", "4"]) == 0
        assert json.loads(capsys.readouterr().out)["num_output_tokens"] == tokens
