.DEFAULT_GOAL := help
PY ?= python

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'

install:  ## flite + sox for the toy world (apt), torch (CPU wheel) first, then the project with judges + dev extras
	@command -v flite >/dev/null && command -v sox >/dev/null || { apt-get update -q && apt-get install -y -q flite sox; } \
		|| { echo "the toy world needs flite and sox: install them (Debian/Ubuntu: apt-get install flite sox)"; exit 1; }
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[judges,dev,slurm]"

# pytest-xdist workers: one per core of a 2-core machine. A test module stays on one worker (its module fixtures
# are built once), and every worker runs torch on one thread (tests/conftest.py), so they do not compete.
TEST_WORKERS ?= 2
PYTEST_ARGS = -q -n $(TEST_WORKERS) --dist loadscope
OFFLINE = HF_HUB_OFFLINE=1 WANDB_MODE=offline

test:  ## fast test suite (minutes; TEST_WORKERS=1 runs it in one process)
	$(OFFLINE) $(PY) -m pytest $(PYTEST_ARGS) --durations=15

COMPAT_VENV ?= .venv-compat
# The tests of every part that calls a versioned API (torch, torchaudio, transformers, lightning, numpy): model
# loading and decoding, tokenizers, the resampler and vocoder path, training and its checkpoints.
COMPAT_TESTS ?= tests/test_environment.py tests/test_features.py tests/test_transformer.py tests/test_cosyvoice2.py \
	tests/test_llasa.py tests/test_model_configs.py tests/test_cosyvoice_pipeline.py tests/test_cosyvoice_tokenizer.py \
	tests/test_batch_invariance.py tests/test_compile.py tests/test_speculative.py tests/test_drafters.py \
	tests/test_sampling.py tests/test_export.py tests/test_prepare.py tests/test_datamodule.py tests/test_training.py \
	tests/test_train_cli.py
test-compat:  ## the version-sensitive tests at the declared floors (torch 2.11 + torchaudio, transformers 4.51.3) in $(COMPAT_VENV)
	$(PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q -c constraints/compat.txt torch torchaudio
	$(COMPAT_VENV)/bin/python -m pip install -q -c constraints/compat.txt -e ".[judges,dev,slurm]"
	$(OFFLINE) $(COMPAT_VENV)/bin/python -m pytest $(PYTEST_ARGS) $(COMPAT_TESTS)

test-slow:  ## the slow tests only
	$(OFFLINE) $(PY) -m pytest $(PYTEST_ARGS) -m slow

lint:  ## ruff
	$(PY) -m ruff check ssd tests scripts *.py
	$(PY) -m ruff format --check ssd tests scripts *.py

toy:  ## build the toy world (corpus, codec, token shards, toy target, toy draft, quality summary)
	HF_HUB_OFFLINE=1 $(PY) scripts/build_toy_world.py

reproduce-toy:  ## every paper table/figure on the toy world into experiments/results/ (after make toy)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) scripts/reproduce.py all --out experiments/results

bench:  ## decoding benchmark (toy + CosyVoice 2 shapes): engine vs HF generate/assisted, AR vs speculative, syncs, batch
	HF_HUB_OFFLINE=1 $(PY) scripts/bench_decoding.py --shape both --out experiments/results/bench_decoding

gpu-check:  ## one-shot CUDA check (< 8 min on an H200): compiled == eager, exactness, timings, FSDP training -> experiments/results/gpu_engine/
	HF_HUB_OFFLINE=1 $(PY) scripts/gpu_check.py

.PHONY: help install test test-compat test-slow lint toy reproduce-toy bench gpu-check
