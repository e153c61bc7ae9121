# One command surface: make install / test / demo / prepare-<dataset> / bench.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SOURCE_MANTIS  ?= TIGER-Lab/Mantis-Instruct
SOURCE_INFOVQA ?= Ahren09/InfoVQA
SOURCE_VIDEO   ?= lmms-lab/LLaVA-Video-178K
WORKERS ?= 2
DEMO   ?= demo_out

.PHONY: install test test-fast demo bench check prepare-mantis prepare-infovqa prepare-llava-video clean

install: $(STAMP)

# torch==2.13.0 first (an unpinned torch pulled by a dependency would be a multi-GB CUDA build),
# unless the venv already imports a torch (e.g. a CUDA build installed by the cluster's recipe).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow"

check: $(STAMP)
	$(PY) -m ruff check . || true

prepare-mantis: $(STAMP)
	$(PY) -m converters mantis --source $(or $(SOURCE),$(SOURCE_MANTIS)) --out $(or $(OUT),data/mantis) --workers $(WORKERS)

prepare-infovqa: $(STAMP)
	$(PY) -m converters infovqa --source $(or $(SOURCE),$(SOURCE_INFOVQA)) --out $(or $(OUT),data/infovqa) --workers $(WORKERS)

prepare-llava-video: $(STAMP)
	$(PY) -m converters llava-video --source $(or $(SOURCE),$(SOURCE_VIDEO)) --out $(or $(OUT),data/llava-video) --workers $(WORKERS)

DEMO_STEPS ?= 30
# The main job on embedded data: lookalikes -> Energon shards -> tiny Qwen-VL trained on each
# dataset on CPU -> loss curves (PNG) and a report with throughput.
demo: $(STAMP)
	$(PY) -m converters.demo --out $(DEMO)
	$(PY) train.py configs/train_qwen_vl_mantis.yaml data.path=$(DEMO)/mantis/metadataset.yaml train.steps=$(DEMO_STEPS) out=$(DEMO)/runs/mantis
	$(PY) train.py configs/train_qwen_vl_infovqa.yaml data.path=$(DEMO)/infovqa/metadataset.yaml train.steps=$(DEMO_STEPS) out=$(DEMO)/runs/infovqa
	$(PY) train.py configs/train_qwen_vl_llava_video.yaml data.path=$(DEMO)/llava-video/metadataset.yaml train.steps=$(DEMO_STEPS) out=$(DEMO)/runs/llava-video
	$(PY) train.py configs/train_qwen_vl_vision_check.yaml data.path=$(DEMO)/vision-check out=$(DEMO)/runs/vision-check
	$(PY) train.py configs/train_qwen_vl_vision_check.yaml data.path=$(DEMO)/vision-check out=$(DEMO)/runs/vision-check-blanked data.blank_media=true
	$(PY) eval.py configs/train_qwen_vl_vision_check.yaml data.path=$(DEMO)/vision-check --ckpt $(DEMO)/runs/vision-check --out $(DEMO)/eval/vision-check
	$(PY) eval.py configs/train_qwen_vl_vision_check.yaml data.path=$(DEMO)/vision-check --ckpt $(DEMO)/runs/vision-check-blanked --out $(DEMO)/eval/vision-check-blanked --blank-media
	$(PY) -m models.report $(DEMO)/report $(DEMO)/runs/mantis $(DEMO)/runs/infovqa $(DEMO)/runs/llava-video $(DEMO)/runs/vision-check $(DEMO)/runs/vision-check-blanked --pair vision-check:vision-check-blanked --eval media=$(DEMO)/eval/vision-check --eval blanked=$(DEMO)/eval/vision-check-blanked --eval-pair media:blanked --chance 0.167

bench: $(STAMP)
	$(PY) bench/bench_converters.py --out bench_out

clean:
	rm -rf $(DEMO) bench_out

# --- training (train.py): the tiny Qwen-VL on the demo shards (`make demo`) on CPU by default.
#     CONFIG= (a YAML in configs/), DATA= (dataset folder or metadataset.yaml), STEPS=, NPROC=
#     (torchrun processes), OUT= (run folder: metrics.jsonl, checkpoints), ARGS= (more key=value).
.PHONY: train-qwen-vl-mantis train-qwen-vl-infovqa train-qwen-vl-llava-video
NPROC ?= 1
TRAIN_LAUNCH = $(if $(filter-out 1,$(NPROC)),$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC),$(PY))
TRAIN_ARGS = $(if $(DATA),data.path=$(DATA)) $(if $(STEPS),train.steps=$(STEPS)) $(if $(OUT),out=$(OUT)) $(ARGS)

train-qwen-vl-mantis: $(STAMP)
	$(TRAIN_LAUNCH) train.py $(or $(CONFIG),configs/train_qwen_vl_mantis.yaml) $(TRAIN_ARGS)

train-qwen-vl-infovqa: $(STAMP)
	$(TRAIN_LAUNCH) train.py $(or $(CONFIG),configs/train_qwen_vl_infovqa.yaml) $(TRAIN_ARGS)

train-qwen-vl-llava-video: $(STAMP)
	$(TRAIN_LAUNCH) train.py $(or $(CONFIG),configs/train_qwen_vl_llava_video.yaml) $(TRAIN_ARGS)

# --- evaluation (eval.py): greedy answers on the val split, scored per subset (docs/evaluation.md).
#     CKPT= (train.py checkpoint dir / step folder, or an hf-to-mcore import; required),
#     CONFIG= (the run config used for training), DATA=, SPLIT= (default val), LIMIT= (val
#     conversations), OUT= (predictions.jsonl + scores.json; default <config out>/eval), ARGS=.
.PHONY: eval-qwen-vl-mantis eval-qwen-vl-infovqa eval-qwen-vl-llava-video
EVAL_ARGS = --ckpt $(CKPT) --split $(or $(SPLIT),val) $(if $(LIMIT),--limit $(LIMIT)) $(if $(OUT),--out $(OUT)) $(if $(DATA),data.path=$(DATA)) $(ARGS)

eval-qwen-vl-mantis: $(STAMP)
	$(PY) eval.py $(or $(CONFIG),configs/train_qwen_vl_mantis.yaml) $(EVAL_ARGS)

eval-qwen-vl-infovqa: $(STAMP)
	$(PY) eval.py $(or $(CONFIG),configs/train_qwen_vl_infovqa.yaml) $(EVAL_ARGS)

eval-qwen-vl-llava-video: $(STAMP)
	$(PY) eval.py $(or $(CONFIG),configs/train_qwen_vl_llava_video.yaml) $(EVAL_ARGS)
