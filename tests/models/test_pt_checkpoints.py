"""PyTorch state-dict checkpoints (pytorch_model.bin, sharded or not) and folders without the usual file names:
vLLM's --load-format auto / safetensors / pt.

The reference is the same weights in model.safetensors: a .bin holding them must give the same greedy tokens and
the same logprobs, bit for bit (same dtype, same kernels)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError
from kvfit.models.loader import checkpoint_files

PROMPTS = [[5, 6, 7, 8], list(range(20, 41))]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)


def _run(folder: str, **kwargs) -> list[tuple[list[int], list[float]]]:
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=128, **kwargs)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory) -> str:
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("st"), arch="llama", seed=21)


@pytest.fixture(scope="module")
def reference(st_folder):
    return _run(st_folder)


def _state(st_folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(st_folder, "model.safetensors"))


def _copy_without_weights(st_folder: str, dest) -> str:
    folder = str(dest)
    shutil.copytree(st_folder, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return folder


def test_a_pytorch_model_bin_loads_the_same_weights(st_folder, reference, tmp_path):
    folder = _copy_without_weights(st_folder, tmp_path / "bin")
    torch.save(_state(st_folder), os.path.join(folder, "pytorch_model.bin"))
    assert checkpoint_files(folder) == [os.path.join(folder, "pytorch_model.bin")]
    assert _run(folder) == reference
    assert _run(folder, load_format="pt") == reference


def test_sharded_bin_with_its_index_loads(st_folder, reference, tmp_path):
    folder = _copy_without_weights(st_folder, tmp_path / "sharded")
    state = _state(st_folder)
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, os.path.join(folder, shard))
        weight_map.update({k: shard for k in keys})
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    assert [os.path.basename(p) for p in checkpoint_files(folder)] == sorted(shards)
    assert _run(folder) == reference


def test_safetensors_under_another_name_load_without_an_index(st_folder, reference, tmp_path):
    """vLLM globs *.safetensors when there is neither model.safetensors nor an index."""
    folder = _copy_without_weights(st_folder, tmp_path / "renamed")
    shutil.copy(os.path.join(st_folder, "model.safetensors"), os.path.join(folder, "weights.safetensors"))
    assert checkpoint_files(folder) == [os.path.join(folder, "weights.safetensors")]
    assert _run(folder) == reference


def test_training_state_beside_the_weights_is_not_read(st_folder, reference, tmp_path):
    folder = _copy_without_weights(st_folder, tmp_path / "training")
    torch.save(_state(st_folder), os.path.join(folder, "weights.bin"))
    with open(os.path.join(folder, "training_args.bin"), "wb") as f:
        f.write(b"not a state dict")
    torch.save({"step": torch.tensor(3)}, os.path.join(folder, "optimizer.bin"))
    assert checkpoint_files(folder) == [os.path.join(folder, "weights.bin")]
    assert _run(folder) == reference


def test_auto_prefers_safetensors_when_both_are_there(st_folder, reference, tmp_path):
    folder = str(tmp_path / "both")
    shutil.copytree(st_folder, folder)
    torch.save({k: torch.zeros_like(v) for k, v in _state(st_folder).items()}, os.path.join(folder, "pytorch_model.bin"))
    assert _run(folder) == reference                       # the .bin's zeros would change every token
    assert _run(folder, load_format="pt") != reference    # --load-format pt reads the .bin


def test_each_format_refuses_a_folder_of_the_other(st_folder, tmp_path):
    with pytest.raises(ConfigError, match="no pytorch_model.bin, pytorch_model.bin.index.json or other"):
        checkpoint_files(st_folder, "pt")
    folder = _copy_without_weights(st_folder, tmp_path / "only-bin")
    torch.save(_state(st_folder), os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(ConfigError, match="no model.safetensors, model.safetensors.index.json or other"):
        checkpoint_files(folder, "safetensors")
    with pytest.raises(ConfigError, match="--load-format 'npz' is not supported"):
        checkpoint_files(folder, "npz")


class _NotATensor:
    pass


@pytest.mark.parametrize("payload", ["code", "not-a-dict", "garbage"])
def test_a_bin_that_is_not_a_state_dict_is_a_one_line_error(st_folder, tmp_path, payload):
    """weights_only: a pickle that would build other objects is refused, never run; a list, or bytes that are
    no pickle at all, are refused too, each with the file's name."""
    folder = _copy_without_weights(st_folder, tmp_path / payload)
    path = os.path.join(folder, "pytorch_model.bin")
    if payload == "code":
        torch.save({"model.embed_tokens.weight": torch.zeros(2), "extra": _NotATensor()}, path)
    elif payload == "not-a-dict":
        torch.save([torch.zeros(2)], path)
    else:
        with open(path, "wb") as f:
            f.write(b"\x00garbage")
    with pytest.raises(ConfigError) as info:
        LLM(folder, device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    message = str(info.value)
    assert "pytorch_model.bin" in message and "\n" not in message
    assert "state dict" in message


def test_the_loading_line_names_the_format(st_folder, tmp_path, caplog):
    import logging
    folder = _copy_without_weights(st_folder, tmp_path / "log")
    torch.save(_state(st_folder), os.path.join(folder, "pytorch_model.bin"))
    with caplog.at_level(logging.INFO, logger="kvfit"):
        _run(folder)
    assert any("of PyTorch state dicts in 1 shard" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_tensor_parallel_rank_reads_the_same_slices_from_a_bin(st_folder, tmp_path, tp_rank):
    """Each rank slices a .bin's tensors as it slices safetensors' lazy ones: rank by rank, the same parameters."""
    from kvfit.attention.torch_ref import TorchReferenceBackend
    from kvfit.model_facts import load_model_facts
    from kvfit.models.loader import load_model
    folder = _copy_without_weights(st_folder, tmp_path / f"tp{tp_rank}")
    torch.save(_state(st_folder), os.path.join(folder, "pytorch_model.bin"))
    facts = load_model_facts(st_folder)
    models = [load_model(path, facts, torch.float32, "cpu", TorchReferenceBackend(), tp_rank=tp_rank, tp_size=2)
              for path in (st_folder, folder)]
    want, got = (dict(m.named_parameters()) for m in models)
    assert want.keys() == got.keys()
    for name, param in want.items():
        assert torch.equal(param, got[name]), name
