# specstream: every task a developer or CI runs. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
PORT   ?= 50051
METRICS_PORT ?= 9464
HOST   ?= 127.0.0.1
METRICS_HOST ?= 127.0.0.1
MODEL  ?= smollm2-135m
PROMPT ?= The capital of France is
GPU_PY ?= 3.12

.PHONY: help setup proto models serve generate test test-gpu check-cuda bench bench-gpu \
        bench-spec bench-concurrency lint wheelhouse clean

help:
	@echo "make serve       set up, start the gRPC server on :$(PORT) (it fetches the model first)"
	@echo "                 (MODEL=..., HOST=... (default 127.0.0.1: this machine only), PORT=...,"
	@echo "                 METRICS_HOST=..., METRICS_PORT=... (-1 = off), SERVE_ARGS='...')"
	@echo "make test        set up, fetch the test models, run the CPU test suite"
	@echo "make generate    stream a completion from the CLI (PROMPT=..., MODEL=...)"
	@echo "make models      fetch smollm2-135m and gemma3-270m into ./models"
	@echo "make test-gpu    run the GPU tests (needs CUDA and CuPy)"
	@echo "make check-cuda  compile the CUDA kernels for sm_90 with NVRTC (no GPU needed)"
	@echo "make bench       CPU decode benchmark and server overhead benchmark"
	@echo "make bench-gpu   GPU GEMV and decode benchmark, goals met/missed (needs CUDA and CuPy;"
	@echo "                 BENCH_ARGS='--quick' or '--only gemv|decode', BENCH_JSON=path), then"
	@echo "                 one stream end to end: graph step, engine loop, gRPC (E2E_ARGS="
	@echo "                 '--llama-bench PATH' adds llama.cpp, see bench/llamacpp_cuda.sh)"
	@echo "make bench-spec  speculative decoding: real drafters, verify steps and an oracle"
	@echo "                 drafter on synthetic 8B/1B (GPU when CuPy is present, else CPU;"
	@echo "                 SPEC_ARGS='--part real|synth ...', SPEC_JSON=path)"
	@echo "make bench-concurrency  streams 1..64 through the gRPC server on the CPU, goals and"
	@echo "                 the prefix-cache TTFT (CONC_JSON=path, CONC_ARGS='--levels 1,4"
	@echo "                 --tokens 64 --plot PNG ...'; the plot needs matplotlib)"
	@echo "make lint        ruff, hadolint (deploy/*Dockerfile), kubernetes-validate (deploy/k8s)"
	@echo "make wheelhouse  wheels for an offline GPU host (Python $(GPU_PY))"

$(BIN)/specstream: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $@

setup: $(BIN)/specstream proto

proto: $(BIN)/specstream
	$(PY) -m service.proto_build

models: $(BIN)/specstream
	$(BIN)/specstream models fetch smollm2-135m
	$(BIN)/specstream models fetch gemma3-270m

# serve fetches the model itself (on first use), so one process logs, in one format
serve: setup
	$(BIN)/specstream serve $(MODEL) --host $(HOST) --port $(PORT) \
	  --metrics-port $(METRICS_PORT) --metrics-host $(METRICS_HOST) $(SERVE_ARGS)

generate: setup
	$(BIN)/specstream generate $(MODEL) --prompt "$(PROMPT)" --max-new-tokens 64

test: setup models
	$(PY) -m pytest -m "not gpu" -q --durations=20

# The GPU host may be offline: test-gpu uses the venv when there is one, else the system python3
# (with the wheelhouse on PYTHONPATH, see bench/gpu_host.sh).
GPU_RUN_PY = $(shell [ -x $(PY) ] && echo $(PY) || echo python3)

test-gpu:
	@$(GPU_RUN_PY) -m pytest -m gpu -q tests/gpu -p no:cacheprovider || { s=$$?; \
	  [ $$s -ne 5 ] || echo "no GPU test ran: CuPy or a CUDA device is missing here"; \
	  exit $$s; }

check-cuda: $(BIN)/specstream
	$(PY) -m service.tools.cuda_check

bench: setup models
	$(PY) bench/cpu_decode.py
	$(PY) bench/server_overhead.py

BENCH_JSON ?= docs/bench-gpu.json
BENCH_ARGS ?=

E2E_ARGS ?=

bench-gpu:
	$(GPU_RUN_PY) bench/gpu_bench.py --json $(BENCH_JSON) $(BENCH_ARGS)
	$(GPU_RUN_PY) bench/e2e_decode.py $(E2E_ARGS)

SPEC_JSON ?= docs/bench-spec.json
SPEC_ARGS ?=

bench-spec:
	$(GPU_RUN_PY) bench/speculative.py --json $(SPEC_JSON) $(SPEC_ARGS)

CONC_JSON ?= docs/bench-concurrency-cpu.json
CONC_ARGS ?=

bench-concurrency: setup models
	$(PY) bench/concurrency.py --json $(CONC_JSON) $(CONC_ARGS)

lint: $(BIN)/specstream
	$(BIN)/ruff check service clients tests bench
	$(BIN)/hadolint --config deploy/hadolint.yaml deploy/Dockerfile deploy/gateway.Dockerfile
	$(BIN)/kubernetes-validate --strict -k 1.31 --quiet deploy/k8s/*.yaml

wheelhouse:
	$(PYTHON) -m pip download --dest wheelhouse --only-binary=:all: \
	  --python-version $(GPU_PY) --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux_2_28_x86_64 --implementation cp \
	  gguf structlog grpcio-health-checking grpcio-reflection grpcio-status prometheus-client \
	  smg-grpc-proto \
	  tokenizers jinja2 numba protobuf grpcio grpcio-tools pytest hypothesis
	# xgrammar without its torch/transformers/triton: GPU hosts have those, and they are gigabytes;
	# pydantic (xgrammar's) and jsonschema (the structured-output tests') they lack
	$(PYTHON) -m pip download --dest wheelhouse --only-binary=:all: --no-deps \
	  --python-version $(GPU_PY) --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_17_x86_64 --implementation cp \
	  xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
	  jsonschema jsonschema-specifications referencing rpds-py

clean:
	rm -rf service/proto build dist *.egg-info .pytest_cache
