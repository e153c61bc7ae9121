"""The README's journey as written: its supported-models table and commands, the export of a run
without ``HF=`` (the README's tiny path) as a complete Hugging Face folder that the README's
transformers snippet (read from README.md itself) loads and generates with, for every family, the
bos / eos / pad ids checked at the start of a run, the refusal of an unknown ``model_type``, and
``make eval-<family>-<dataset>`` refusing a checkpoint of another family or dataset."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.test_train import FAST, ok, train

README = REPO / "README.md"
#: family -> (train config, overrides: the tiny model of that family with the test tokenizer)
RUNS = {
    "qwen2_5_vl": ("configs/train_qwen_vl_mantis.yaml", ()),
    "qwen3_vl": ("configs/train_qwen_vl_mantis.yaml",
                 ("model.base=configs/qwen3_vl_tiny.yaml", "model.lm.vocab_size=448",
                  "task_encoder.model=qwen3_vl")),
    "qwen3_vl_moe": ("configs/train_qwen3_vl_moe_mantis.yaml", ()),
    "qwen3_5": ("configs/train_qwen3_5_moe_mantis.yaml",
                ("model.base=configs/qwen3_5_tiny.yaml", "model.lm.vocab_size=448",
                 "task_encoder.model=qwen3_5")),
    "qwen3_5_moe": ("configs/train_qwen3_5_moe_mantis.yaml", ()),
    "nemotron_omni": ("configs/train_nemotron_omni_mantis.yaml", ()),
}
#: families the README trains only from a Hugging Face folder (``HF=``; no tiny config of their
#: own): family -> train config
HF_ONLY = {"cosmos3_omni": "configs/train_qwen_vl_mantis.yaml"}
#: EXIF orientation 6: stored landscape, shown (and trained) portrait
ROTATED = 6


def readme_snippet() -> str:
    """The README's transformers snippet (the python block after "Then load it")."""
    found = re.search(r"Then load it with\s+transformers.*?```python\n(.*?)```", README.read_text(),
                      re.S)
    assert found, "README.md has no transformers snippet"
    return found.group(1)


def readme_bash() -> list[str]:
    """The command lines of the README's bash blocks (continuations joined, comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def rotated_photo(path: Path) -> Path:
    """A JPEG stored 96 x 48 with EXIF orientation 6 (it shows 48 wide, 96 high)."""
    from PIL import Image

    image = Image.new("RGB", (96, 48), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = ROTATED
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif.tobytes())
    path.write_bytes(buffer.getvalue())
    return path


#: the runs whose exports the README's snippet loads: every family without ``HF=`` (its tiny
#: config) and started from a tiny model folder of ``python -m lookalikes.models`` (``HF=``)
FROM_HF = "-from-hf"
SNIPPET_RUNS = [*RUNS, *(f"{family}{FROM_HF}" for family in [*RUNS, *HF_ONLY])]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, mantis_out) -> dict[str, tuple[Path, Path]]:
    """``SNIPPET_RUNS`` name -> (run folder, export) of a 2-step tiny run, without ``HF=`` (the
    families of ``RUNS``) or started from ``python -m lookalikes.models``' folder of that family,
    exported with the README's command."""
    from lookalikes.models import main as write_model

    root = tmp_path_factory.mktemp("journey")
    made = {}
    for name in SNIPPET_RUNS:
        family = name.removesuffix(FROM_HF)
        config, extra = RUNS[family] if family in RUNS else (HF_ONLY[family], ())
        if name.endswith(FROM_HF):
            hf = root / f"hf_{family}"
            assert write_model(["--family", family, "--out", str(hf)]) == 0
            extra = (f"model.hf={hf}", f"train.hf_import_cache={root / 'imports'}")
        run, export = root / f"run_{name}", root / f"export_{name}"
        proc = train(config, f"data.path={mantis_out}/metadataset.yaml", f"out={run}", *FAST,
                     "train.steps=2", "train.eval_interval=0", "checkpoint.save_final=true",
                     *extra)
        ok(proc)
        last = proc.stdout.strip().splitlines()[-1]
        assert last.startswith(f"[train] done: metrics {run / 'metrics.jsonl'}, checkpoint "
                               f"{run / 'checkpoints' / 'step_000002'}"), last
        proc = subprocess.run([str(REPO / ".venv/bin/python"), "-m", "models.convert",
                               "mcore-to-hf", "--mcore", str(run), "--out", str(export)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"[convert] mcore-to-hf: wrote the Hugging Face model folder {export} ")
        made[name] = run, export
    return made


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(RUNS))
def test_export_without_hf_is_a_complete_folder_whose_generate_stops(exports, family):
    """config, weights, tokenizer with the training chat template, processor and generation
    configs; the eos id is the tokenizer's, inside the vocabulary, and ``generate`` stops there
    (the model loads as the README loads it: ``device_map="auto"``, accelerate)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    _run, export = exports[family]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
                 "generation_config.json", "preprocessor_config.json",
                 "video_preprocessor_config.json", "processor_config.json"):
        assert (export / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(export)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == eos
    config = json.loads((export / "config.json").read_text())
    assert config["text_config"]["eos_token_id"] == eos < config["text_config"]["vocab_size"]
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == eos
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is shown?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.bfloat16,
                                                        device_map="auto")
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                    return_tensors="pt").to(model.device)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False,
                         sequence_bias={(eos,): 100.0})  # the model says eos at once
    assert out.shape[1] == ids["input_ids"].shape[1] + 1 and out[0, -1] == eos


#: runs the README's snippet (argv[1]) in each folder of argv[2:] (its exports/qwen_vl_mantis and
#: photo.jpg, as the README names them): one RESULT line per folder
PROBE = """import json, os, runpy, sys, traceback
for folder in sys.argv[2:]:
    os.chdir(folder)
    try:
        scope = runpy.run_path(sys.argv[1])
        inputs = scope["inputs"]
        result = {"grids": {k: inputs[k].tolist() for k in inputs if k.startswith("image_grid")},
                  "prompt": inputs["input_ids"].shape[1], "out": scope["out"].shape[1]}
    except Exception:
        result = {"error": traceback.format_exc()}
    print("RESULT " + json.dumps(result), flush=True)
"""
#: pip's words for a registry it cannot reach (the one case the snippet test skips)
OFFLINE = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is "
                     r"unreachable|ProxyError|Could not fetch URL|Name or service not known")


@pytest.fixture(scope="module")
def infer_python() -> Path:
    """``make infer-venv``'s interpreter (the README's venv for its snippet on a CPU machine),
    built here when missing (about 2 minutes once; instant when present). Skipped, with a warning,
    only when pip cannot reach its registry."""
    proc = subprocess.run(["make", "infer-venv"], cwd=REPO, capture_output=True, text=True,
                          timeout=1200)
    if proc.returncode != 0 and OFFLINE.search(proc.stdout + proc.stderr):
        message = ("README SNIPPET NOT TESTED: make infer-venv cannot reach the package registry "
                   f"({OFFLINE.search(proc.stdout + proc.stderr).group(0)})")
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return REPO / ".venv-infer" / "bin" / "python"


@pytest.fixture(scope="module")
def snippet_results(exports, infer_python, tmp_path_factory) -> dict[str, dict]:
    """family -> what the README's snippet, unchanged, made in the inference venv (one process
    for every family) of ``exports/qwen_vl_mantis`` = that family's export and ``photo.jpg`` = a
    rotated photo."""
    root = tmp_path_factory.mktemp("snippet")
    (root / "snippet.py").write_text(readme_snippet())
    folders = []
    for family, (_run, export) in sorted(exports.items()):  # a family or a family-from-hf run
        (root / family / "exports").mkdir(parents=True)
        (root / family / "exports" / "qwen_vl_mantis").symlink_to(export)
        rotated_photo(root / family / "photo.jpg")
        folders.append(str(root / family))
    proc = subprocess.run([str(infer_python), "-c", PROBE, str(root / "snippet.py"), *folders],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines()
             if ln.startswith("RESULT ")]
    return dict(zip(sorted(exports), lines, strict=True))


def test_runs_cover_every_family():
    from contract.families import FAMILIES

    assert sorted([*RUNS, *HF_ONLY]) == sorted(FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SNIPPET_RUNS))
def test_readme_snippet_runs_on_the_export(snippet_results, family):
    """The README's snippet, as written there, run by ``make infer-venv``'s python on the export
    of every family's run, without ``HF=`` and started from ``python -m lookalikes.models``'
    folder: it generates, and the rotated photo reaches the processor upright (EXIF orientation
    applied, as in training)."""
    result = snippet_results[family]
    assert "error" not in result, result.get("error")
    (grid,) = result["grids"].values()
    height, width = grid[0][-2:]
    assert height > width, grid  # shown portrait
    assert result["out"] > result["prompt"]


def test_readme_table_lists_every_family():
    """The supported-models table at the top names every family of the registry with its HF
    model_type."""
    from contract.families import HF_MODEL_TYPES

    text = README.read_text()
    start = text.index("## Supported models")
    table = text[start:text.index("```bash", start)]
    for family, model_type in HF_MODEL_TYPES.items():
        assert re.search(rf"^\| `{family}` .*\| `{model_type}` \|", table, re.M), family


def test_readme_commands_run_as_written():
    """Every Python command runs with the venv's interpreter (no activated venv assumed);
    inspect / preview on data/ name ``--tokenizer test`` or a run config (offline)."""
    lines = readme_bash()
    bare = [line for line in lines if re.match(r"(python3?|torchrun) ", line)]
    assert not bare, bare
    offline = [line for line in lines if re.search(r"energon_tasks (inspect|preview) ", line)]
    assert offline and all("--tokenizer test" in line or "--config" in line
                           for line in offline), offline
    assert "make install" in lines[lines.index(next(line for line in lines
                                                    if "lookalikes" in line)) - 1]


def test_unknown_model_type_names_the_file_and_the_families(tmp_path, capsys):
    from contract.families import HF_MODEL_TYPES
    from models.convert import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    assert main(["hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert f"{tmp_path / 'config.json'}: model_type 'llava' is no supported family" in err, err
    assert all(f"{family} (model_type {hf_type})" in err
               for family, hf_type in HF_MODEL_TYPES.items()), err


@pytest.mark.slow
def test_hf_eos_outside_the_tokenizer_is_refused_at_start(tmp_path, mantis_out):
    """A model.hf whose config.json names an eos id its tokenizer does not have: one line
    naming the file and the key, before any model is built."""
    from lookalikes.models import build_tiny_hf_model

    hf = build_tiny_hf_model("qwen2_5_vl", tmp_path / "hf", pixels=(3136, 6272))
    config = json.loads((hf / "config.json").read_text())
    config["text_config"]["eos_token_id"] = 151645  # the hub's id, not the test tokenizer's
    (hf / "config.json").write_text(json.dumps(config))
    proc = train("configs/train_qwen_vl_mantis.yaml", f"model.hf={hf}", *FAST,
                 f"data.path={mantis_out}/metadataset.yaml", f"out={tmp_path / 'run'}",
                 f"train.hf_import_cache={tmp_path / 'cache'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: model.hf ") and \
        f"{hf / 'config.json'}: text_config.eos_token_id 151645 is outside the tokenizer's" \
        in last, last
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_make_eval_checks_family_and_dataset(exports, capsys):
    """``make eval-<family>-<dataset>`` passes its train config as ``--expect``: a checkpoint of
    another family, or trained on another dataset, is one line naming both."""
    import eval as eval_script

    run, _export = exports["qwen2_5_vl"]
    line = subprocess.run(["make", "-n", "eval-nemotron-omni-infovqa", f"CKPT={run}"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
    assert "--expect configs/train_nemotron_omni_infovqa.yaml" in line
    many = subprocess.run(["make", "-n", "eval-qwen-vl-mantis", f"CKPT={run}", "NPROC=4"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "-m recipes.launch --standalone --nproc-per-node 4 eval.py" in many  # MoE: EP 4
    assert "parallel.tp=1 parallel.pp=1 parallel.cp=1 parallel.ep=4 parallel.etp=1" in many
    for config, wanted in (("train_nemotron_omni_mantis", "nemotron_omni on mantis"),
                           ("train_qwen_vl_infovqa", "qwen2_5_vl on infovqa")):
        assert eval_script.main(["--ckpt", str(run), "--expect", f"configs/{config}.yaml"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(
            f"eval.py: error: --ckpt {run} is qwen2_5_vl trained on mantis, but "
            f"configs/{config}.yaml is {wanted}"), err
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["family"] == "qwen2_5_vl"
    from models.checkpointing.checkpoint import read_checkpoint

    for name, (other_run, _export) in exports.items():  # every family its train target trains
        family = name.removesuffix(FROM_HF)
        target = "nemotron_omni" if family == "nemotron_omni" else "qwen_vl"
        eval_script.check_expected(read_checkpoint(str(other_run)),
                                   f"configs/train_{target}_mantis.yaml")


def test_make_install_brings_what_the_snippet_needs():
    """``make install`` installs the ``hf`` extra: transformers and accelerate (``device_map=
    "auto"``), no torchvision (it would replace the CPU torch); ``make infer-venv`` puts the
    torch + torchvision pair in a venv of its own."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = [re.split(r"[<>=~ \[]", dep)[0] for dep in extras["hf"]]
    assert {"transformers", "accelerate"} <= set(names) and "torchvision" not in names
    plan = subprocess.run(["make", "-n", "-B", "install"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout
    assert "pip install -q -e '.[test,hf]'" in plan and "torchvision" not in plan
    infer = subprocess.run(["make", "-n", "infer-venv"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout
    assert "torchvision==" in infer and ".venv/" not in infer  # its own venv, not make install's


def test_readme_snippet_opens_images_as_training_does(tmp_path):
    """The image the README's snippet hands the processor is the one training decodes: EXIF
    orientation applied (a photo stored on its side is seen upright), RGB."""
    import numpy as np

    from energon_tasks.decode import decode_image

    snippet = readme_snippet()
    found = re.search(r"images=\[(.*?)\], return_tensors", snippet)
    assert found, snippet
    photo = rotated_photo(tmp_path / "photo.jpg")
    imports = "\n".join(line for line in snippet.splitlines() if line.startswith(("import ",
                                                                                   "from ")))
    scope: dict = {}
    exec(compile(imports.replace("AutoModelForImageTextToText, AutoProcessor", "AutoConfig"),
                 "README.md", "exec"), scope)  # noqa: S102 - the README's own lines
    image = eval(found.group(1).replace('"photo.jpg"', repr(str(photo))), scope)  # noqa: S307
    assert image.mode == "RGB" and image.size == (48, 96)  # (width, height): upright
    trained = decode_image(photo.read_bytes(), size=(48, 96), max_source_pixels=10**6,
                           draft=False).pixels  # the planned size of the stored 96 x 48
    assert trained.shape == (96, 48, 3)
    assert np.abs(trained.astype(int) - np.asarray(image).astype(int)).max() <= 2


def test_conversion_ends_naming_the_dataset_it_wrote(sources, tmp_path):
    """The converter's last line names the folder it wrote and the file training reads."""
    from tests.conftest import run_cli

    out = tmp_path / "mantis"
    proc = run_cli("converters", "mantis", "--source", str(sources["mantis"]), "--out", str(out),
                   "--shard-size", "8")
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"[converters] wrote the Energon dataset to {out} (train on "
                           f"{out / 'metadataset.yaml'};"), last
