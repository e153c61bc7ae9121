"""eval.py and models/generation/generate.py: greedy tokens equal transformers' generate; end to end
on the lookalike val splits with a tiny imported model; bad input is one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lookalikes.models import build_tiny_hf
from recipes.scores import aggregate, parse_options, score_answer
from tests import runner
from tests.conftest import REPO

NEVER = 151645  # the tiny configs' eos id: outside their vocabularies, never generated


def _tiny_hf(family: str, out: Path, *, vocab: int = 300, tokens: dict | None = None,
             seed: int = 0) -> Path:
    """The parity tests' tiny model with room for eval prompts (2048 positions, 2 ViT blocks)."""
    return build_tiny_hf(family, out, vocab=vocab, tokens=tokens, max_positions=2048,
                         vision_depth=2, seed=seed)


def _import(hf: Path, out: Path) -> Path:
    proc = runner.run("-m models.convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


TEST_TOKENS = dict(image_token_id=5, video_token_id=6, vision_start_token_id=3,
                   vision_end_token_id=4)  # energon_tasks.tokenizer test tokenizer ids


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (HF folder, hf-to-mcore import) of the tiny random models. The Qwen2.5-VL one
    has the test tokenizer's vocabulary and ids (eval.py runs it on the lookalike data)."""
    root = tmp_path_factory.mktemp("gen")
    hf = {"qwen2_5_vl": _tiny_hf("qwen2_5_vl", root / "qwen2_5_vl" / "hf", vocab=640,
                                 tokens=TEST_TOKENS),
          "qwen3_vl": _tiny_hf("qwen3_vl", root / "qwen3_vl" / "hf")}
    return {f: (path, _import(path, root / f / "mcore")) for f, path in hf.items()}


# ------------------------------------------------------------------ 1. identical greedy tokens
def _prompts(cfg):
    """A text-only prompt and a text + image + text prompt (random ids above the specials)."""
    from models.generation.generate import Prompt
    from models.layers.mrope import mrope_positions

    g = torch.Generator().manual_seed(3)
    v, merge = cfg.vision, cfg.vision.spatial_merge_size

    def text(n):
        return torch.randint(8, 280, (n,), generator=g)

    grid = torch.tensor([[1, 4, 6]])
    n_visual = int(grid.prod()) // merge ** 2
    ids = torch.cat([text(5), torch.tensor([cfg.vision_start_token_id]),
                     torch.full((n_visual,), cfg.image_token_id),
                     torch.tensor([cfg.vision_end_token_id]), text(4)])
    pixels = torch.randn(int(grid.prod()), v.in_channels * v.temporal_patch_size
                         * v.patch_size ** 2, generator=g)
    plain = text(9)
    return {"text": Prompt(plain, mrope_positions(plain, [], set(), merge)[:, 0]),
            "image": Prompt(ids, mrope_positions(ids, list(grid), {cfg.image_token_id},
                                                 merge)[:, 0], pixels, grid)}


def _hf_greedy(hf, prompt, image_token: int, new: int, eos: int) -> list[int]:
    ids = prompt.input_ids[None]
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt.pixel_values is not None:  # transformers 5 needs the token types for M-RoPE
        kwargs.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                      mm_token_type_ids=(ids == image_token).int())
    out = hf.generate(**kwargs, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                      pad_token_id=0)[0, ids.shape[1]:].tolist()
    return out[:out.index(eos)] if eos in out else out


def _greedy_check(family: str, hf_dir: str, mcore_dir: str) -> dict:
    """Runs in a fresh process (megatron's parallel state and the Manager of dist_checkpointing
    stay out of the pytest process)."""
    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import load_hf_model
    from models.generation.generate import greedy_generate
    from models.parallel import init_parallel

    init_parallel()
    model, cfg = load_checkpoint(Path(mcore_dir), use_te=False)
    hf = load_hf_model(Path(hf_dir))
    prompts = _prompts(cfg)
    result = {}
    for name, prompt in prompts.items():
        ours = greedy_generate(model, [prompt], eos_id=NEVER, max_new_tokens=10)[0]
        result[name] = (ours, _hf_greedy(hf, prompt, cfg.image_token_id, 10, NEVER))
        stop = ours[3]  # stopping: a token of the unbounded run as the stop token
        result[name + "_stop"] = (greedy_generate(model, [prompt], eos_id=stop,
                                                  max_new_tokens=10)[0],
                                  _hf_greedy(hf, prompt, cfg.image_token_id, 10, stop),
                                  ours.index(stop))
    batched = greedy_generate(model, list(prompts.values()), eos_id=NEVER, max_new_tokens=10)
    result["batched"] = (batched, [result[n][0] for n in prompts])
    return result


def _greedy_main(argv: list[str]) -> int:
    print("RESULT" + json.dumps(_greedy_check(*argv)))
    return 0


def _run_check(family, hf_dir, mcore_dir):
    proc = runner.run("tests.test_eval:_greedy_main", family, str(hf_dir), str(mcore_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_greedy_tokens_equal_transformers_generate(imported, family):
    hf_dir, mcore_dir = imported[family]
    result = _run_check(family, hf_dir, mcore_dir)
    for name in ("text", "image"):
        ours, theirs = result[name]
        assert len(ours) == 10 and ours == theirs, (name, ours, theirs)
        ours, theirs, stop_at = result[name + "_stop"]
        assert ours == theirs and len(ours) == stop_at, (name, ours, theirs)
    batched, single = result["batched"]
    assert batched == single  # left-padded batch == one prompt at a time


# ------------------------------------------------------------------ 2. eval.py end to end
@pytest.fixture(scope="module")
def eval_ckpt(imported) -> Path:
    return imported["qwen2_5_vl"][1]


def run_eval(*args: str) -> subprocess.CompletedProcess:
    """eval.py in a process of its own (tests/runner.py)."""
    return runner.run("eval.py", *args)


def main_error(capsys, *args: str) -> str:
    """The one-line error (exit code 2) of eval.py's main() run in this process, for bad input
    found before any process group or model is set up."""
    sys.path.insert(0, str(REPO))
    import eval as script

    capsys.readouterr()
    code = script.main(list(args))
    err = capsys.readouterr().err
    return _one_line_exit_2(subprocess.CompletedProcess(args, code, "", err))


SMALL = ["task_encoder.max_pixels=12544", "task_encoder.video_max_pixels=12544",
         "task_encoder.max_num_frames=4", "task_encoder.video_fps=1.0"]


@pytest.mark.slow
@pytest.mark.parametrize("name,config", [
    ("mantis_out", "configs/train_qwen_vl_mantis.yaml"),
    ("infovqa_out", "configs/train_qwen_vl_infovqa.yaml"),
    ("video_out", "configs/train_qwen_vl_llava_video.yaml")])
def test_eval_end_to_end(request, eval_ckpt, tmp_path, name, config):
    data = request.getfixturevalue(name)
    out = tmp_path / "eval"
    proc = run_eval(config, f"data.path={data}", *SMALL, "--ckpt", str(eval_ckpt),
                    "--limit", "4", "--max-new-tokens", "6", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads((out / "scores.json").read_text())
    records = [json.loads(ln) for ln in (out / "predictions.jsonl").read_text().splitlines()]
    assert records and scores["questions"] == len(records)
    for r in records:
        assert {"key", "prompt", "prediction", "references", "score"} <= set(r)
        assert 0.0 <= r["score"] <= 1.0 and r["references"]
    for group in (scores["overall"], *scores["subsets"].values(), *scores["datasets"].values()):
        assert all(0.0 <= v <= 1.0 for k, v in group.items() if k != "n")
    budget = scores["budget_counters"]
    assert budget["samples"] >= len(records) and "kept" in budget
    assert scores["generation"]["tokens_per_s"] > 0
    assert "[overall]" in proc.stdout and "budget counters" in proc.stdout
    if name == "infovqa_out":
        assert "anls" in scores["overall"]


@pytest.mark.slow
def test_eval_end_to_end_qwen3_5(mantis_out, tmp_path):
    """eval.py on a Qwen3.5 checkpoint (the Qwen-VL task encoder with the qwen3_5 profile;
    generation with the Gated DeltaNet states cached): predictions and scores written."""
    from lookalikes.models import build_tiny_qwen3_5

    hf = build_tiny_qwen3_5(tmp_path / "hf", vocab=640, tokens=TEST_TOKENS, max_positions=2048)
    ckpt = _import(hf, tmp_path / "mcore")
    out = tmp_path / "eval"
    proc = run_eval("configs/train_qwen_vl_mantis.yaml", f"data.path={mantis_out}",
                    "task_encoder.model=qwen3_5", *SMALL, "--ckpt", str(ckpt), "--limit", "4",
                    "--max-new-tokens", "6", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads((out / "scores.json").read_text())
    records = [json.loads(ln) for ln in (out / "predictions.jsonl").read_text().splitlines()]
    assert records and scores["questions"] == len(records)
    assert scores["generation"]["tokens_per_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe", "nemotron_omni"])
def test_eval_moe_over_two_processes_equals_one(family, mantis_out, tmp_path):
    """A MoE checkpoint (Qwen3-VL-MoE; Qwen3.5 MoE with its Gated DeltaNet states; Nemotron-Omni
    with MoE and Mamba layers, randomly initialised) evaluated under torchrun with its experts
    over 2 ranks (``parallel.ep=2``: every rank generates the same answers, the lean decode
    step summing each rank's experts; rank 0 writes) writes the one-process eval's predictions;
    a layout it does not run is one line."""
    from lookalikes.models import build_tiny_qwen3_5

    ckpt = tmp_path / "mcore"
    if family == "nemotron_omni":
        config, small = "configs/train_nemotron_omni_mantis.yaml", SMALL[2:]
        init = runner.run("tests/init_checkpoint.py", config, str(ckpt), "model.lm.pattern=*E-E")
        assert init.returncode == 0, init.stderr[-3000:]
    else:
        config, small = "configs/train_qwen_vl_mantis.yaml", [*SMALL,
                                                              f"task_encoder.model={family}"]
        hf = (build_tiny_hf(family, tmp_path / "hf", vocab=640, tokens=TEST_TOKENS,
                            max_positions=2048, vision_depth=2) if family == "qwen3_vl_moe"
              else build_tiny_qwen3_5(tmp_path / "hf", moe=True, vocab=640, tokens=TEST_TOKENS,
                                      max_positions=2048))
        _import(hf, ckpt)
    common = [config, f"data.path={mantis_out}", *small, "--ckpt", str(ckpt), "--limit", "3",
              "--max-new-tokens", "6", "--progress-every", "0"]
    one = run_eval(*common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = runner.run("eval.py", *common, "parallel.ep=2", "--out", str(tmp_path / "two"),
                     nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]

    def predictions(name):
        lines = (tmp_path / name / "predictions.jsonl").read_text().splitlines()
        return [(r["key"], r["prediction"], r["generated_tokens"]) for r in map(json.loads, lines)]

    assert predictions("two") == predictions("one") and len(predictions("one")) >= 3
    for name in ("one", "two"):  # EP 2: the lean step with one all-reduce per MoE layer
        scores = json.loads((tmp_path / name / "scores.json").read_text())
        assert scores["generation"]["lean_decode"] is True, name
    assert two.stdout.count("[overall]") == 1  # rank 0 reports, once
    assert sum(r[2] for r in predictions("two")) > 0
    wrong = runner.run("eval.py", *common, "parallel.ep=2", "parallel.tp=2", "--out",
                       str(tmp_path / "bad"), nproc=2)
    line = _one_line_exit_2(wrong)
    assert "parallel.tp 2" in line and "parallel.ep=2" in line, line


def same_rows_worker(argv=None) -> int:
    """One of 2 ranks at EP 2 (``runner.run("tests.test_eval:same_rows_worker", nproc=2)``):
    generation's precondition holds for the same ids and media on both ranks only."""
    import torch.distributed as dist

    from models.generation.generate import Prompt, same_prompts_on_expert_ranks
    from models.parallel import init_parallel

    init_parallel(ep=2)
    rank = dist.get_rank()

    def same(ids, pixels=None):
        rows = [Prompt(row, row[None].expand(3, -1), pixel_values=pixels) for row in ids]
        return same_prompts_on_expert_ranks(ids, rows)

    ids = torch.arange(12).reshape(2, 6)
    one_token = ids.clone()
    one_token[1, 3] += rank
    swapped = ids.flip(0) if rank else ids  # the same tokens, rows in another order
    wider = torch.zeros(2, 6 + rank, dtype=torch.long)
    checks = [same(t) for t in (ids, one_token, swapped, wider)]
    pixels = torch.ones(4, 6)
    other_pixels = pixels * (1 + rank)  # the same ids, another image on each rank
    checks += [same(ids, pixels), same(ids, other_pixels), same(ids, None if rank else pixels)]
    if checks != [True, False, False, False, True, False, False]:
        return 1
    from models.families import build_model
    from models.families.qwen_vl.config import load_yaml
    from models.generation.generate import greedy_generate

    cfg = load_yaml(REPO / "configs" / "qwen3_vl_moe_tiny.yaml")  # 4 experts, 2 per rank
    model = build_model(cfg, use_te=False).eval()
    ids = torch.arange(8, 8 + 6 + rank)  # another prompt on each rank
    prompt = Prompt(ids, ids[None].expand(3, -1).clone())
    try:
        greedy_generate(model, [prompt], eos_id=10 ** 6, max_new_tokens=3)
    except ValueError as error:
        return 0 if "same prompts on every expert-parallel rank" in str(error) else 1
    return 1


def test_generation_with_experts_over_ranks_needs_the_same_rows():
    """Experts over ranks: generation (every EP rank in each step; the lean step summing each
    rank's experts by one all-reduce) runs only where every EP rank has the same rows; other
    rows are refused (``greedy_generate``: ValueError), never a hang."""
    proc = runner.run("tests.test_eval:same_rows_worker", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_eval_layouts_over_processes():
    """eval.py's layout: one process whatever the run trained at; over N processes a MoE model's
    experts over the N ranks, nothing else (one line saying what to pass)."""
    sys.path.insert(0, str(REPO))
    import eval as script
    from contract.errors import UsageError
    from models.families.qwen_vl.config import load_yaml
    from recipes.run_config import load_run_config

    moe = load_yaml(REPO / "configs" / "qwen3_vl_moe_tiny.yaml")  # 4 experts
    dense = load_yaml(REPO / "configs" / "qwen3_vl_tiny.yaml")
    trained = load_run_config(REPO / "configs" / "train_qwen_vl_mantis.yaml",
                              ["parallel.tp=2", "parallel.ep=4"])
    assert script.expert_ranks(trained, moe, 1) == 1
    for world in (2, 4):
        cfg = load_run_config(REPO / "configs" / "train_qwen_vl_mantis.yaml",
                              [f"parallel.ep={world}"])
        assert script.expert_ranks(cfg, moe, world) == world
    with pytest.raises(UsageError, match=r"parallel.tp 2, pp 1, cp 1, ep 4, etp 2.*"
                                         r"parallel.tp=1 .*parallel.ep=4 parallel.etp=1"):
        script.expert_ranks(trained, moe, 4)
    with pytest.raises(UsageError, match="qwen3_vl has none: run it in one process"):
        script.expert_ranks(cfg, dense, 4)
    three = load_run_config(REPO / "configs" / "train_qwen_vl_mantis.yaml", ["parallel.ep=3"])
    with pytest.raises(UsageError, match="4 experts do not split over 3 ranks"):
        script.expert_ranks(three, moe, 3)


# ------------------------------------------------------------------ 3. bad input
def _one_line_exit_2(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("eval.py: error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_bad_checkpoint_family(imported, infovqa_out, tmp_path, capsys):
    _hf, qwen3 = imported["qwen3_vl"]  # a Qwen3-VL checkpoint for a Qwen2.5-VL task encoder
    line = main_error(capsys, "configs/train_qwen_vl_infovqa.yaml", f"data.path={infovqa_out}",
                      "--ckpt", str(qwen3), "--out", str(tmp_path / "e"))
    assert "qwen3_vl" in line


def test_missing_checkpoint_is_one_usage_line(capsys):
    """eval.py and make eval-... without a checkpoint: one line naming what to pass."""
    assert "--ckpt CKPT is required" in main_error(capsys, "configs/x.yaml")
    venv = Path(sys.executable).parents[1]
    proc = subprocess.run(["make", "-s", "-o", str(venv / ".installed"), f"VENV={venv}",
                           "eval-qwen-vl-mantis"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "usage: make eval-qwen-vl-mantis CKPT=" in proc.stderr


def test_not_a_checkpoint(infovqa_out, tmp_path, capsys):
    line = main_error(capsys, "configs/train_qwen_vl_infovqa.yaml", f"data.path={infovqa_out}",
                      "--ckpt", str(tmp_path), "--out", str(tmp_path / "e"))
    assert "not a checkpoint" in line


def test_no_val_split(eval_ckpt, infovqa_out, tmp_path, capsys):
    meta = tmp_path / "train_only.yaml"
    meta.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
                    f"    path: {infovqa_out}\n")
    line = main_error(capsys, "configs/train_qwen_vl_infovqa.yaml", f"data.path={meta}",
                      "--ckpt", str(eval_ckpt), "--out", str(tmp_path / "e"))
    assert "no 'val' split" in line


def test_empty_after_budget(eval_ckpt, infovqa_out, tmp_path):
    """Found after the samples are read (process group and model set up): a process."""
    proc = run_eval("configs/train_qwen_vl_infovqa.yaml", f"data.path={infovqa_out}",
                    "task_encoder.max_visual_tokens=1", "--ckpt", str(eval_ckpt), "--limit", "2",
                    "--out", str(tmp_path / "e"))
    assert "after budgeting" in _one_line_exit_2(proc)


def _file_size_limit() -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails (EFBIG), no signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))  # below the predictions file


@pytest.mark.slow
def test_a_full_disk_while_writing_the_results_is_one_line(eval_ckpt, mantis_out, tmp_path):
    """A write that fails for lack of space (a file-size limit standing in for a full disk: the
    same OSError through the same writes) is one line, exit 1, and leaves no results that look
    complete: neither a half-written predictions.jsonl nor the scores.json of an earlier eval in
    the same folder."""
    from energon_tasks.tokenizer import build_test_tokenizer

    tokenizer = build_test_tokenizer(tmp_path / "tokenizer")  # read, not written, by the eval
    out = tmp_path / "e"
    out.mkdir()
    for name in ("scores.json", "predictions.jsonl"):  # an earlier eval's results
        (out / name).write_text("{}\n")
    proc = subprocess.run(
        [sys.executable, "eval.py", "configs/train_qwen_vl_mantis.yaml",
         f"data.path={mantis_out}/metadataset.yaml", *SMALL, f"task_encoder.tokenizer={tokenizer}",
         "--ckpt", str(eval_ckpt), "--limit", "8", "--max-new-tokens", "6", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, preexec_fn=_file_size_limit)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("eval.py: error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "predictions.jsonl" in errors[0] and \
        "File too large" in errors[0] and "no scores.json" in errors[0], errors
    assert list(out.iterdir()) == []


# ------------------------------------------------------------------ scoring glue
REAL_MC = ("What is the man doing in the video?\nOptions:\nA. running.\nB. swimming.\n"
           "C. cooking.\nD. dancing.\nE. training.\nPlease provide your answer by stating the "
           "letter followed by the full option.")  # LLaVA-Video-178K's form (placeholder removed)


def test_parse_options_real_and_other_forms():
    assert parse_options(REAL_MC) == {"A": "running.", "B": "swimming.", "C": "cooking.",
                                      "D": "dancing.", "E": "training."}
    # only the block after "Options:" counts: lines above it that look like options do not
    steps = "Steps shown:\nA. wash\nB. cut\n" + REAL_MC
    assert parse_options(steps) == parse_options(REAL_MC)
    assert parse_options("Which way?\nA. up\nB. down\nC. left\nAnswer with the option's "
                         "letter.") == {"A": "up", "B": "down", "C": "left"}
    assert parse_options("Pick:\n(A) up\n(B) down") == {"A": "up", "B": "down"}
    assert parse_options("What is 1. this") is None
    assert parse_options("Options:\nA. up\nC. down") is None       # letters not in order
    assert parse_options("Options:\nA. up\nPlease answer.") is None  # one option
    assert parse_options("Options:\nA. up\nA. down") is None        # repeated letter


@pytest.mark.parametrize("prediction, reference, metric, value", [
    ("E. training.", "E. training.", "option_acc", 1.0),   # answer and output in the dataset's form
    ("E", "E. training.", "option_acc", 1.0),
    ("(E)", "E. training.", "option_acc", 1.0),
    ("The answer is E.", "E. training.", "option_acc", 1.0),
    ("e. training.", "E. training.", "option_acc", 0.0),   # lower case: no letter read
    ("training.", "E. training.", "option_acc", 0.0),      # the text without its letter
    ("A. running.", "E. training.", "option_acc", 0.0),
    ("Answer: E", "E. training.", "option_acc", 0.0),      # Video-MME's rule reads the A
    ("E", "E", "option_acc", 1.0),                         # a bare letter as reference
    ("E", "training.", "option_acc", 1.0),                 # reference given as the option text
    ("training.", "F. flying.", "exact", 0.0),             # reference names no option: exact match
])
def test_score_answer_multiple_choice(prediction, reference, metric, value):
    got_metric, scores = score_answer("llava-video", REAL_MC, prediction, [reference])
    assert (got_metric, scores[metric]) == (metric, value)


def test_score_answer_routes_metrics():
    question = "Which way?\nA. up\nB. down\nC. left\nAnswer with the option's letter."
    assert score_answer("llava-video", question, "The answer is (B)", ["B"]) == (
        "option_acc", {"option_acc": 1.0})
    assert score_answer("llava-video", question, "left", ["B"])[1]["option_acc"] == 0.0
    metric, s = score_answer("infovqa", "q", "83098 ", ["83,098", "83098"])
    assert metric == "anls" and s["anls"] == 1.0
    metric, s = score_answer("infovqa", "q", "43", ["42"])  # exactly the 0.5 threshold: kept
    assert metric == "anls" and s["anls"] == 0.5
    metric, s = score_answer("mantis", "q", "41", ["42"])
    assert metric == "exact" and s == {"exact": 0.0, "relaxed": 1.0}
    records = [{"dataset": "mantis", "subset": "mantis/a", "score": 1.0, "scores": {"exact": 1.0}},
               {"dataset": "mantis", "subset": "mantis/b", "score": 0.0, "scores": {"exact": 0.0}}]
    agg = aggregate(records)
    assert agg["overall"] == {"n": 2, "exact": 0.5, "score": 0.5}
    assert agg["subsets"]["mantis/a"]["score"] == 1.0
