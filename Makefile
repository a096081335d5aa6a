PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q
STAMP := $(VENV)/.installed

.PHONY: demo test bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/streamer train

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup

bench: $(STAMP)
	$(PY) -m benchmarks.bench

gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) runs
