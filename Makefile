# One command surface: make install / test / demo / prepare-<dataset> / train-<family>-<dataset> /
# export-<family>-<dataset> / eval-<family>-<dataset> / bench.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SOURCE_MANTIS  ?= TIGER-Lab/Mantis-Instruct
SOURCE_INFOVQA ?= Ahren09/InfoVQA
SOURCE_VIDEO   ?= lmms-lab/LLaVA-Video-178K
WORKERS ?= 2
# REVISION=<branch, tag or commit> pins the hub source of make prepare-* (default: main, resolved
# once to a commit at the start)
PREPARE_REVISION = $(if $(REVISION),--revision $(REVISION))
DEMO   ?= demo_out
# One data root: make prepare-<dataset> writes $(DATA_ROOT)/<dataset>, make train-<family>-<dataset>
# reads $(DATA_ROOT)/<dataset>/metadataset.yaml (the train configs' own default is data/ too).
# make demo keeps its own shards under $(DEMO); train on them with DATA_ROOT=$(DEMO).
DATA_ROOT ?= data

.PHONY: install infer-venv test test-fast demo bench bench-loader check prepare-mantis prepare-infovqa prepare-llava-video clean

install: $(STAMP)

# torch==2.13.0 first (an unpinned torch pulled by a dependency would be a multi-GB CUDA build),
# unless the venv already imports a torch (e.g. a CUDA build installed by the cluster's recipe).
$(STAMP): pyproject.toml energon_tasks/_resample.c
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $(STAMP)

# The venv the README's transformers snippet runs in on a CPU machine (the tests run it there):
# transformers' processors need torchvision, and PyPI has none that imports beside make install's
# CPU torch. A torch + torchvision pair that PyPI ships together, by architecture (x86_64: a CUDA
# build, which runs on the CPU too), and make install's transformers and accelerate. Skipped when
# the venv already holds these pins; other pins reinstall into it.
INFER_VENV ?= .venv-infer
INFER_TORCH := $(if $(filter aarch64 arm64,$(shell uname -m)),torch==2.9.1 torchvision==0.24.1,torch==2.14.1 torchvision==0.29.1)
INFER_HF := transformers==5.24.0 accelerate==1.16.0
infer-venv:
	@test "$$(cat $(INFER_VENV)/.installed 2>/dev/null)" = "$(INFER_TORCH) $(INFER_HF)" || { \
	  set -e; test -x $(INFER_VENV)/bin/python || python3 -m venv $(INFER_VENV); \
	  $(INFER_VENV)/bin/python -m pip install -q --upgrade pip; \
	  $(INFER_VENV)/bin/python -m pip install -q $(INFER_TORCH); \
	  $(INFER_VENV)/bin/python -m pip install -q $(INFER_HF); \
	  echo "$(INFER_TORCH) $(INFER_HF)" > $(INFER_VENV)/.installed; }
	@echo "[make] infer-venv: $(INFER_VENV) ($(INFER_TORCH) $(INFER_HF))"

# The suite runs over TEST_WORKERS processes (pytest-xdist), a test file each at a time (module
# fixtures such as the SLURM cluster stay in one process): 15:42 on 2 cores against 31:21 in one
# process (same tree, 852 tests)
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=50

test-fast: $(STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m "not slow"

check: $(STAMP)
	$(PY) -m ruff check .

prepare-mantis: $(STAMP)
	$(PY) -m converters mantis --source $(or $(SOURCE),$(SOURCE_MANTIS)) --out $(or $(OUT),$(DATA_ROOT)/mantis) --workers $(WORKERS) $(PREPARE_REVISION)

prepare-infovqa: $(STAMP)
	$(PY) -m converters infovqa --source $(or $(SOURCE),$(SOURCE_INFOVQA)) --out $(or $(OUT),$(DATA_ROOT)/infovqa) --workers $(WORKERS) $(PREPARE_REVISION)

prepare-llava-video: $(STAMP)
	$(PY) -m converters llava-video --source $(or $(SOURCE),$(SOURCE_VIDEO)) --out $(or $(OUT),$(DATA_ROOT)/llava-video) --workers $(WORKERS) $(PREPARE_REVISION)

DEMO_STEPS ?= 30
FAMILIES := qwen-vl nemotron-omni
DATASETS := mantis infovqa llava-video
# demo_family(family): train the tiny model of a family on each demo dataset, then the
# vision-signal pair (with media, blanked) and the eval of both
define demo_family
	$(PY) train.py configs/train_$(subst -,_,$(1))_mantis.yaml data.path=$(DEMO)/mantis/metadataset.yaml train.steps=$(DEMO_STEPS) out=$(DEMO)/runs/$(1)-mantis
	$(PY) train.py configs/train_$(subst -,_,$(1))_infovqa.yaml data.path=$(DEMO)/infovqa/metadataset.yaml train.steps=$(DEMO_STEPS) out=$(DEMO)/runs/$(1)-infovqa
	$(PY) train.py configs/train_$(subst -,_,$(1))_llava_video.yaml data.path=$(DEMO)/llava-video/metadataset.yaml train.steps=$(DEMO_STEPS) out=$(DEMO)/runs/$(1)-llava-video
	$(PY) train.py configs/train_$(subst -,_,$(1))_vision_check.yaml data.path=$(DEMO)/vision-check out=$(DEMO)/runs/$(1)-vision-check
	$(PY) train.py configs/train_$(subst -,_,$(1))_vision_check.yaml data.path=$(DEMO)/vision-check out=$(DEMO)/runs/$(1)-vision-check-blanked data.blank_media=true
	$(PY) eval.py configs/train_$(subst -,_,$(1))_vision_check.yaml data.path=$(DEMO)/vision-check --ckpt $(DEMO)/runs/$(1)-vision-check --out $(DEMO)/eval/$(1)-vision-check
	$(PY) eval.py configs/train_$(subst -,_,$(1))_vision_check.yaml data.path=$(DEMO)/vision-check --ckpt $(DEMO)/runs/$(1)-vision-check-blanked --out $(DEMO)/eval/$(1)-vision-check-blanked --blank-media
endef
DEMO_RUNS = $(foreach f,$(FAMILIES),$(foreach r,mantis infovqa llava-video vision-check vision-check-blanked,$(DEMO)/runs/$(f)-$(r)))
DEMO_CHECKS = $(foreach f,$(FAMILIES),--pair $(f)-vision-check:$(f)-vision-check-blanked --eval $(f)=$(DEMO)/eval/$(f)-vision-check --eval $(f)-blanked=$(DEMO)/eval/$(f)-vision-check-blanked --eval-pair $(f):$(f)-blanked)
# The main job on embedded data: lookalikes -> Energon shards -> tiny Qwen-VL and tiny
# Nemotron-Omni trained on each dataset on CPU -> loss curves (PNG) and a report with
# throughput, the vision-signal checks and the eval accuracy with / without media. The checks
# (the vision-signal race of both families: loss and eval accuracy, with media vs blanked) are
# proved here, not in make test: make demo fails unless every one PASSED.
DEMO_GATE = import json, sys; c = json.load(open(sys.argv[1]))["checks"]; \
	sys.exit(0 if len(c) == 2 * len("$(FAMILIES)".split()) and all(x["passed"] for x in c) else \
	"make demo: a check did NOT PASS: " + json.dumps([x for x in c if not x["passed"]] or c))
demo: $(STAMP)
	$(PY) -m lookalikes.demo --out $(DEMO)
	rm -rf $(DEMO)/runs $(DEMO)/eval
	$(call demo_family,qwen-vl)
	$(call demo_family,nemotron-omni)
	$(PY) -m recipes.report $(DEMO)/report $(DEMO_RUNS) $(DEMO_CHECKS) --chance 0.167
	$(PY) -c '$(DEMO_GATE)' $(DEMO)/report/report.json

bench: $(STAMP)
	$(PY) bench/bench_converters.py --out bench_out

# The published loader benchmark (docs/loader-benchmark.md): the loader per family and dataset
# against the Hugging Face paths, which run in $(INFER_VENV) (make infer-venv; without it they are
# skipped with a line); about 7 minutes on 2 cores. ROUNDS= (default 7).
bench-loader: $(STAMP)
	$(PY) bench/bench_loader.py --out bench_out/loader_benchmark --doc docs/loader-benchmark.md --infer-venv $(INFER_VENV) --rounds $(or $(ROUNDS),7)

clean:
	rm -rf $(DEMO) bench_out

# --- training (train.py): the configs' tiny models on CPU by default, or a Hugging Face model.
#     make train-<family>-<dataset>, family qwen-vl | nemotron-omni, dataset mantis | infovqa |
#     llava-video, on $(DATA_ROOT)/<dataset>. HF= (hub id or folder: start from that model's
#     weights, tokenizer and pixel settings = model.hf), CONFIG= (a YAML in configs/), DATA=
#     (dataset folder or metadataset.yaml), STEPS=, NPROC= (torchrun processes), OUT= (run
#     folder: metrics.jsonl, checkpoints), ARGS= (more key=value).
TRAIN_TARGETS := $(foreach f,$(FAMILIES),$(foreach d,$(DATASETS),train-$(f)-$(d)))
EXPORT_TARGETS := $(foreach f,$(FAMILIES),$(foreach d,$(DATASETS),export-$(f)-$(d)))
EVAL_TARGETS := $(foreach f,$(FAMILIES),$(foreach d,$(DATASETS),eval-$(f)-$(d)))
.PHONY: $(TRAIN_TARGETS) $(EXPORT_TARGETS) $(EVAL_TARGETS)
NPROC ?= 1
LAUNCH = $(if $(filter-out 1,$(NPROC)),$(PY) -m recipes.launch --standalone --nproc-per-node $(NPROC),$(PY))
# dataset_of(qwen-vl-llava-video) -> llava-video
dataset_of = $(strip $(foreach f,$(FAMILIES),$(patsubst $(f)-%,%,$(filter $(f)-%,$(1)))))
TRAIN_ARGS = data.path=$(or $(DATA),$(DATA_ROOT)/$(call dataset_of,$*)/metadataset.yaml) $(if $(HF),model.hf=$(HF)) $(if $(STEPS),train.steps=$(STEPS)) $(if $(OUT),out=$(OUT)) $(ARGS)
# train-qwen-vl-llava-video -> configs/train_qwen_vl_llava_video.yaml
run_config = configs/train_$(subst -,_,$(1)).yaml

$(TRAIN_TARGETS): train-%: $(STAMP)
	$(LAUNCH) train.py $(or $(CONFIG),$(call run_config,$*)) $(TRAIN_ARGS)

# --- export (models.convert mcore-to-hf): a train.py checkpoint as a Hugging Face model folder
#     (weights, config, tokenizer, chat template, processor files) that transformers loads.
#     make export-<family>-<dataset>. CKPT= (run folder, checkpoints/ or one step_N folder;
#     default the config's run folder runs/<family>_<dataset>), OUT= (default exports/<family>_<dataset>).
$(EXPORT_TARGETS): export-%: $(STAMP)
	$(PY) -m models.convert mcore-to-hf --mcore $(or $(CKPT),runs/$(subst -,_,$*)) --out $(or $(OUT),exports/$(subst -,_,$*))

# --- evaluation (eval.py): greedy answers on the val split, scored per subset (docs/evaluation.md).
#     make eval-<family>-<dataset>. CKPT= (required: a train.py run folder, its checkpoints
#     folder or a step folder, whose stored run config is used; or an hf-to-mcore import, which
#     takes configs/train_<family>_<dataset>.yaml), CONFIG= (a YAML refining it), DATA=, SPLIT=
#     (default val), LIMIT= (val conversations), OUT= (predictions.jsonl + scores.json; default
#     eval_<step> beside the checkpoint), NPROC= (a MoE model too big for one GPU: its experts
#     over NPROC torchrun ranks), ARGS=. The checkpoint must be of a family the target's train
#     target trains (eval-qwen-vl-*: every Qwen family, contract/families.py MAKE_FAMILIES) and
#     trained on its dataset (--expect: one line naming the target that fits otherwise).
EVAL_LAYOUT = $(if $(filter-out 1,$(NPROC)),parallel.tp=1 parallel.pp=1 parallel.cp=1 parallel.ep=$(NPROC) parallel.etp=1)
EVAL_ARGS = --ckpt $(CKPT) --expect $(call run_config,$*) --split $(or $(SPLIT),val) $(if $(LIMIT),--limit $(LIMIT)) $(if $(OUT),--out $(OUT)) $(if $(DATA),data.path=$(DATA)) $(EVAL_LAYOUT) $(ARGS)
EVAL_USAGE = usage: make $@ CKPT=<run folder | checkpoints folder | step folder | hf-to-mcore import> [DATA=] [SPLIT=] [LIMIT=] [OUT=] [CONFIG=] [NPROC=] [ARGS=]

$(EVAL_TARGETS): eval-%: $(STAMP)
	$(if $(CKPT),,$(error $(EVAL_USAGE)))
	$(LAUNCH) eval.py $(or $(CONFIG),$(if $(wildcard $(CKPT)/model_config.json $(CKPT)/qwen_vl_model.json),$(call run_config,$*))) $(EVAL_ARGS)

# --- SLURM (slurm/*.sbatch, docs/training.md "SLURM"): print the exact sbatch command (the dry
#     run: see what would be submitted without a cluster), or submit it with SUBMIT=1.
#     make slurm-prepare-<dataset> PARTS=<P> (array size, default 8) SOURCE= OUT= (a shared
#     filesystem) CPUS= (per task, default 16); make slurm-train-<family>-<dataset> NODES=<N>
#     (default 1) GPUS=<per node, default 8; 0: a CPU cluster> and the train-* variables
#     (CONFIG=, DATA=, HF=, STEPS=, OUT=, ARGS=). One task per node runs torchrun, which starts one
#     training process per GPU of its node. slurm/submit.sh builds the command from these
#     variables, which reach it as environment variables only (make exports what the command
#     line sets; none is written into a shell command line), so no value runs as shell.
SLURM_PREPARE_TARGETS := $(foreach d,$(DATASETS),slurm-prepare-$(d))
SLURM_TRAIN_TARGETS := $(foreach f,$(FAMILIES),$(foreach d,$(DATASETS),slurm-train-$(f)-$(d)))
.PHONY: $(SLURM_PREPARE_TARGETS) $(SLURM_TRAIN_TARGETS)
# the default sources reach slurm/submit.sh as environment variables too
export SOURCE_MANTIS SOURCE_INFOVQA SOURCE_VIDEO

$(SLURM_PREPARE_TARGETS): slurm-prepare-%:
	@bash slurm/submit.sh prepare $*

$(SLURM_TRAIN_TARGETS): slurm-train-%:
	@bash slurm/submit.sh train $(call run_config,$*) $(call dataset_of,$*)
