PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q
STAMP := $(VENV)/.installed

.PHONY: demo test test-latest bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/streamer train

# The linter and the type checker first (seconds): a finding fails the run before the suite starts.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15

# The suite against the newest releases of every dependency but torch, in its own venv: a coming break
# shows here before a pin in constraints.txt moves. It may fail; `make test` may not.
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip -q install torch==2.13.0
	$(LATEST)/bin/pip -q install --upgrade -e '.[test]'
	$(LATEST)/bin/pip list | grep -iE '^(transformers|peft|accelerate|datasets|tokenizers|safetensors) '
	$(LATEST)/bin/python -m pytest -n 2 --dist loadgroup

# DeepSpeed (the bench extra) is a contender; its NVMe offload's async I/O builds against libaio-dev.
bench: $(STAMP)
	$(PIP) install -c constraints.txt -e '.[bench]'
	@if command -v dpkg >/dev/null && ! dpkg -s libaio-dev >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get install -y -q libaio-dev || { apt-get update -q && apt-get install -y -q libaio-dev; }; \
	  else echo "DeepSpeed's NVMe offload needs libaio-dev: sudo apt-get install libaio-dev"; fi; fi
	$(PY) -m benchmarks.bench

gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) $(LATEST) runs
