"""Model ids from the local Hugging Face cache (offline): kvfit.hub.resolve_model and the commands using it.

The cache is a fake one built in tmp_path with huggingface_hub's layout: models--org--name/refs/<ref> holds a
commit hash, snapshots/<hash>/ the files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvfit.cli import main
from kvfit.errors import ConfigError
from kvfit.hub import hub_cache_dir, resolve_model, resolve_model_name

MAIN_HASH = "a" * 40
V1_HASH = "b" * 40


def add_to_cache(cache: Path, model_id: str, folder: str, refs: dict[str, str]) -> dict[str, Path]:
    """Put `folder` into the cache as `model_id`, one snapshot per commit in refs ({ref: commit})."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    snapshots = {}
    for ref, commit in refs.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)     # huggingface_hub writes the hash without a newline
        snapshot = repo / "snapshots" / commit
        if not snapshot.exists():
            shutil.copytree(folder, snapshot)
        snapshots[ref] = snapshot
    return snapshots


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_llama) -> tuple[Path, dict[str, Path]]:
    root = tmp_path / "hub"
    snapshots = add_to_cache(root, "org/tiny", tiny_llama, {"main": MAIN_HASH, "v1": V1_HASH})
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.chdir(tmp_path)      # no ./org/tiny folder shadows the id
    return root, snapshots


def test_an_id_resolves_to_the_snapshot_main_points_at(cache):
    _, snapshots = cache
    assert resolve_model("org/tiny") == snapshots["main"]
    assert resolve_model("org/tiny", "v1") == snapshots["v1"]
    assert resolve_model("org/tiny", V1_HASH) == snapshots["v1"]       # a commit hash names the snapshot


def test_an_existing_folder_or_config_is_returned_as_is(cache, tiny_llama):
    assert resolve_model(tiny_llama) == Path(tiny_llama)
    config = str(Path(tiny_llama) / "config.json")
    assert resolve_model(config) == Path(config)


def test_catalog_names_stay_names(cache):
    assert resolve_model_name("llama-3.1-8b") == "llama-3.1-8b"


def test_a_missing_id_names_the_places_looked(cache):
    root, _ = cache
    with pytest.raises(ConfigError) as err:
        resolve_model("org/absent")
    msg = str(err.value)
    assert "\n" not in msg and "org/absent" in msg
    assert str(root / "models--org--absent") in msg and "never downloads" in msg


def test_a_missing_revision_lists_the_cached_refs(cache):
    with pytest.raises(ConfigError) as err:
        resolve_model("org/tiny", "v2")
    assert "no revision 'v2'" in str(err.value) and "main, v1" in str(err.value)


def test_an_incomplete_snapshot_is_an_error(cache, tmp_path):
    root, _ = cache
    (root / "models--org--half" / "refs").mkdir(parents=True)
    (root / "models--org--half" / "refs" / "main").write_text(MAIN_HASH)
    (root / "models--org--half" / "snapshots" / MAIN_HASH).mkdir(parents=True)
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model("org/half")


@pytest.mark.parametrize("revision", ["../../etc", "/abs", "a..b"])
def test_revisions_cannot_escape_the_cache(cache, revision):
    with pytest.raises(ConfigError, match="--revision"):
        resolve_model("org/tiny", revision)


def test_a_revision_with_a_folder_is_an_error(cache, tiny_llama):
    with pytest.raises(ConfigError, match="drop --revision"):
        resolve_model(tiny_llama, "v1")


def test_a_path_that_does_not_exist_is_named(cache):
    with pytest.raises(ConfigError, match="it does not exist"):
        resolve_model("./missing-folder")


def test_cache_folder_from_the_environment(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_hub_needs_no_torch():
    code = "import sys, kvfit.hub; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_huggingface_hub_agrees_where_installed(cache):
    hub = pytest.importorskip("huggingface_hub")
    root, snapshots = cache     # huggingface_hub reads HF_HUB_CACHE once, at import: pass the folder
    assert Path(hub.snapshot_download("org/tiny", cache_dir=root, local_files_only=True)) == snapshots["main"]
    assert Path(hub.snapshot_download("org/tiny", revision="v1", cache_dir=root,
                                      local_files_only=True)) == snapshots["v1"]


def test_plan_an_id_from_the_cache(cache, capsys):
    assert main(["plan", "org/tiny", "--device-memory", "4GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "org/tiny" and plan["fits"]


def test_generate_an_id_at_a_revision(cache, capsys):
    args = ["--prompt-token-ids", "5,6,7", "--max-tokens", "2", "--temperature", "0", "--device", "cpu",
            "--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-model-len", "64", "--json"]
    assert main(["generate", "org/tiny", "--revision", "v1", *args]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["prompt"] == [5, 6, 7] and len(row["token_ids"]) == 2
    assert main(["generate", "org/tiny", "--revision", "nope", *args]) == 2
    assert "no revision 'nope'" in capsys.readouterr().err


def test_the_offline_api_takes_an_id(cache):
    from kvfit import LLM
    _, snapshots = cache
    llm = LLM("org/tiny", device="cpu", dtype="float32", kv_cache_memory="4MiB", max_model_len=64)
    try:
        assert llm.config.model.model == str(snapshots["main"])
    finally:
        llm.shutdown()
