"""Hostile Hugging Face model folders: what the import (``models.convert hf-to-mcore``, the same
read as ``model.hf``'s cached import) and ``verify`` do with a folder that is not what its
files claim. Each case is one line naming the file and the key (``models.convert: error: ...``,
exit 2), never a traceback or a silently wrong weight: sharded saves read through their index
(a stale shard ignored, a missing or misplaced one named), shapes the config declares compared
with the safetensors headers before anything is allocated, config values megatron cannot
build, broken processor files, and ``verify`` on a pickle-only folder or another family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lookalikes.models import build_tiny_hf_model

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny HF Qwen2.5-VL folder (config, weights, tokenizer, processor files)."""
    return build_tiny_hf_model("qwen2_5_vl", tmp_path_factory.mktemp("hf") / "qwen2_5_vl",
                               pixels=(3136, 6272))


def _copy(tiny: Path, to: Path) -> Path:
    shutil.copytree(tiny, to)
    return to


def _shard(folder: Path) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Re-save ``folder``'s weights as two shards with an index, as ``save_pretrained`` does;
    returns (the weights, the first shard's keys, the second's)."""
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(weights)
    first, second = keys[: len(keys) // 2], keys[len(keys) // 2:]
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name, part in zip(names, (first, second), strict=True):
        save_file({k: weights[k] for k in part}, str(folder / name), metadata={"format": "pt"})
    index = {k: names[0] for k in first} | {k: names[1] for k in second}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return weights, first, second


def _import(hf: Path, out: Path, capsys) -> tuple[int, str]:
    """``models.convert hf-to-mcore`` in this process: (exit code, the stderr's last line)."""
    from models.convert import main

    code = main(["hf-to-mcore", "--hf", str(hf), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _refused(hf: Path, tmp_path: Path, capsys, *said: str) -> str:
    code, line = _import(hf, tmp_path / "mcore", capsys)
    assert code == 2 and line.startswith("models.convert: error: "), line
    for part in said:
        assert part in line, line
    return line


def test_a_sharded_folder_is_read_through_its_index(tiny, tmp_path, capsys):
    """A shard of an older save left in the folder (not in the index) is not read: the import
    equals the folder's weights; the index's own shards are all read."""
    from models.hf.weights import read_hf_folder

    hf = _copy(tiny, tmp_path / "hf")
    weights, first, _second = _shard(hf)
    stale = {k: weights[k] + 1.0 for k in first}  # same keys, other values, sorted last
    save_file(stale, str(hf / "model-00003-of-00003.safetensors"))
    _config, read = read_hf_folder(hf)
    assert read.keys() == weights.keys()
    assert all(torch.equal(read[k], weights[k]) for k in weights)
    assert _import(hf, tmp_path / "mcore", capsys)[0] == 0


def test_a_missing_or_misplaced_shard_is_named(tiny, tmp_path, capsys):
    hf = _copy(tiny, tmp_path / "missing")
    _shard(hf)
    (hf / "model-00002-of-00002.safetensors").unlink()
    _refused(hf, tmp_path, capsys, "model-00002-of-00002.safetensors", "missing", INDEX)

    hf = _copy(tiny, tmp_path / "misplaced")
    weights, first, second = _shard(hf)
    index = json.loads((hf / INDEX).read_text())
    index["weight_map"][first[0]] = "model-00002-of-00002.safetensors"  # it is in the first
    (hf / INDEX).write_text(json.dumps(index))
    _refused(hf, tmp_path, capsys, "model-00001-of-00002.safetensors", repr(first[0]),
             "places it in model-00002-of-00002.safetensors")

    hf = _copy(tiny, tmp_path / "lacking")
    weights, first, second = _shard(hf)
    index = json.loads((hf / INDEX).read_text())
    del index["weight_map"][first[1]]  # listed nowhere now, but still in the file
    (hf / INDEX).write_text(json.dumps(index))
    _refused(hf, tmp_path, capsys, "does not list it", repr(first[1]))
    index["weight_map"][first[1]] = "model-00001-of-00002.safetensors"
    save_file({k: weights[k] for k in first if k != first[1]},  # listed, but not in the file
              str(hf / "model-00001-of-00002.safetensors"))
    (hf / INDEX).write_text(json.dumps(index))
    _refused(hf, tmp_path, capsys, f"places {first[1]!r} in model-00001-of-00002.safetensors",
             "lacks it")


def test_without_an_index_a_key_in_two_files_is_named(tiny, tmp_path, capsys):
    hf = _copy(tiny, tmp_path / "hf")
    weights = load_file(str(hf / "model.safetensors"))
    key = sorted(weights)[0]
    save_file({key: weights[key] * 2}, str(hf / "zz-old.safetensors"))
    _refused(hf, tmp_path, capsys, repr(key), "model.safetensors", "zz-old.safetensors",
             "remove the stale file")


@pytest.fixture(scope="module")
def configs(tiny, tmp_path_factory) -> dict[str, dict]:
    """family package -> a tiny model's config.json (Qwen2.5-VL, Qwen3.5, Nemotron-Omni)."""
    from lookalikes.models import build_tiny_nemotron_omni, build_tiny_qwen3_5

    root = tmp_path_factory.mktemp("configs")
    folders = {"qwen_vl": tiny, "qwen3_5": build_tiny_qwen3_5(root / "qwen3_5"),
               "nemotron_omni": build_tiny_nemotron_omni(root / "nemotron_omni")}
    return {name: json.loads((folder / "config.json").read_text())
            for name, folder in folders.items()}


#: (family package, config.json key, value, what the line says)
UNBUILDABLE = [
    ("qwen_vl", "text_config.num_hidden_layers", 0, "is 0"),
    ("qwen_vl", "vision_config.depth", 0, "is 0"),
    ("qwen_vl", "text_config.num_key_value_heads", 3,
     "text_config.num_attention_heads 4 is not a multiple of text_config.num_key_value_heads 3"),
    ("qwen_vl", "vision_config.num_heads", 3, "vision_config.hidden_size 32 is not a multiple"),
    ("qwen_vl", "text_config.num_attention_heads", 0, "is 0"),
    ("qwen3_5", "text_config.num_hidden_layers", 0, "is 0"),
    ("qwen3_5", "text_config.linear_num_key_heads", 3, "linear_num_value_heads 4 is not a"),
    ("nemotron_omni", "vision_config.num_hidden_layers", 0, "is 0"),
    ("nemotron_omni", "text_config.num_key_value_heads", 3, "is not a multiple of"),
    ("nemotron_omni", "text_config.n_groups", 3, "mamba_num_heads 8 is not a multiple"),
]


@pytest.mark.parametrize("package,key,value,said", UNBUILDABLE,
                         ids=[f"{p}-{k}" for p, k, _v, _s in UNBUILDABLE])
def test_config_values_no_model_is_built_of_are_one_line(package, key, value, said, configs,
                                                         tmp_path, capsys):
    """Read before anything is built: the line names config.json and the key."""
    config = json.loads(json.dumps(configs[package]))
    section, name = key.split(".")
    config[section][name] = value
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(config))
    _refused(hf, tmp_path, capsys, f"{hf / 'config.json'}: ", key, said, "fix config.json")


HUGE = 2**40  #: a vocab_size whose embedding (2**40 x 64 floats) no machine allocates


def test_a_declared_shape_the_weights_lack_is_refused_before_anything_is_allocated(
        tiny, tmp_path, capsys):
    """config.json's vocab_size against the safetensors headers (the import, ``model.hf``), and
    an import folder's model_config.json against its dist checkpoint's metadata (export, eval):
    one line each, before the model is built."""
    from models.convert import main

    hf = _copy(tiny, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["text_config"]["vocab_size"] = HUGE
    (hf / "config.json").write_text(json.dumps(config))
    _refused(hf, tmp_path, capsys, "word_embeddings.weight", "(448, 64)", str(HUGE),
             "config.json declares", "nothing was allocated")

    mcore = tmp_path / "import"
    assert _import(tiny, mcore, capsys)[0] == 0
    declared = json.loads((mcore / "model_config.json").read_text())
    declared["lm"]["vocab_size"] = HUGE
    (mcore / "model_config.json").write_text(json.dumps(declared))
    code = main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(tmp_path / "export")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("models.convert: error: "), line
    assert f"word_embeddings.weight of shape ({HUGE}, 64)" in line and "(448, 64)" in line, line


#: (processor file, its content, what the line names)
BAD_PROCESSORS = [
    ("preprocessor_config.json", {"merge_size": 0}, "merge_size is 0"),
    ("preprocessor_config.json", [{"merge_size": 2}], "a list, not a JSON object"),
    ("video_preprocessor_config.json", {"size": {"longest_edge": -5}}, "size.longest_edge is -5"),
    ("preprocessor_config.json", {"size": [3136, 6272], "min_pixels": None, "max_pixels": None},
     "size is [3136, 6272], not an object"),
]


@pytest.mark.parametrize("file,content,said", BAD_PROCESSORS,
                         ids=[s.split(" ")[0] for _f, _c, s in BAD_PROCESSORS])
def test_a_processor_file_no_processor_reads_is_one_line(file, content, said, tiny, tmp_path,
                                                         capsys):
    """A run from the folder (``model.hf``) and its import refuse it naming the file and the key
    (a ``merge_size`` of 0 was read as absent: the run trained and the export shipped it)."""
    from contract.errors import ConfigError
    from recipes.run_config import load_run_config
    from tests.test_train import MANTIS_CFG

    hf = _copy(tiny, tmp_path / "hf")
    before = json.loads((hf / file).read_text())
    (hf / file).write_text(json.dumps(content if isinstance(content, list)
                                      else {**before, **content}))
    with pytest.raises(ConfigError) as info:
        load_run_config(MANTIS_CFG, [f"model.hf={hf}"])
    assert "\n" not in str(info.value) and f"{hf / file}: " in str(info.value), info.value
    assert said in str(info.value), info.value
    _refused(hf, tmp_path, capsys, f"{hf / file}: ", said)


def test_verify_refuses_a_pickle_only_folder_and_another_family(tiny, configs, tmp_path,
                                                                capsys):
    """A pickle is never loaded (the line asks for safetensors; transformers' own error would
    suggest weights_only=False); an HF model of another family than the checkpoint is named."""
    from models.convert import main

    mcore = tmp_path / "import"
    assert _import(tiny, mcore, capsys)[0] == 0
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny / name, pickled / name)
    torch.save(load_file(str(tiny / "model.safetensors")), pickled / "pytorch_model.bin")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(configs["nemotron_omni"]))
    for hf, said in ((pickled, ("pytorch_model.bin is a pickle", "safetensors")),
                     (other, ("is a nemotron_omni model", "a qwen2_5_vl checkpoint"))):
        code = main(["verify", "--hf", str(hf), "--mcore", str(mcore)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith("models.convert: error: "), err[-3:]
        assert all(part in err[-1] for part in said), err[-1]
        assert not any("Traceback" in line or "weights_only" in line for line in err), err


def test_null_processor_values_are_absent(tiny, tmp_path):
    """transformers writes ``"size": null`` where a processor has none: read as absent."""
    from recipes.run_config import load_run_config
    from tests.test_train import MANTIS_CFG

    hf = _copy(tiny, tmp_path / "hf")
    before = json.loads((hf / "preprocessor_config.json").read_text())
    (hf / "preprocessor_config.json").write_text(json.dumps({**before, "size": None}))
    cfg = load_run_config(MANTIS_CFG, [f"model.hf={hf}"])
    assert (cfg.task_encoder.min_pixels, cfg.task_encoder.max_pixels) == (3136, 6272)


def test_the_fingerprint_is_the_content_wherever_the_files_are(tiny, tmp_path, monkeypatch):
    """A copy without -p (new modification times), a restore or a move give the same
    fingerprint (an adapter-only checkpoint's base is recognised); other weights another one;
    a content hash is read once (cached by path, size and time beside the import cache); the
    fingerprint earlier versions recorded still matches unchanged files."""
    import os

    from huggingface_hub import constants

    import models.checkpointing.folders
    from models.hf import source as hf_source

    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf_home"))
    first = hf_source.fingerprint(tiny)
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy, copy_function=shutil.copyfile)  # no -p: new times
    stat = (copy / "model.safetensors").stat()
    os.utime(copy / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert hf_source.fingerprint(copy) == first
    assert hf_source.same_model(first, copy) == (True, first)
    cached = json.loads((tmp_path / "hf_home" / "vlm-sft-imports" /
                         hf_source.HASH_CACHE).read_text())
    assert str((copy / "model.safetensors").resolve()) in cached
    hf_source._HASHES.clear()  # a new process: the shared cache answers, nothing is read
    monkeypatch.setattr(models.checkpointing.folders, "sha256_of", lambda path: 1 / 0)
    assert hf_source.fingerprint(copy) == first
    monkeypatch.undo()

    weights = load_file(str(copy / "model.safetensors"))
    key = sorted(weights)[0]
    save_file({**weights, key: weights[key] + 1}, str(copy / "model.safetensors"),
              metadata={"format": "pt"})
    assert hf_source.same_model(first, copy)[0] is False
    legacy = hf_source.legacy_fingerprint(tiny)
    assert hf_source.same_model(legacy, tiny) == (True, legacy)
