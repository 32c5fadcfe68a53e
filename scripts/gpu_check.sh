#!/usr/bin/env bash
# The GPU checks for a lent CUDA machine (docs/GPU.md), in stages named as arguments (default: tests bench):
#   tests  the conformance suite (slow included) and the torch-backend, bench and generation tests on CUDA
#   bench  `linnet bench`, bf16, Qwen2.5-0.5B shapes, 512 prompt + 128 new: every torch mode vs transformers
#   peer   the same against transformers compiled, apart: it compiles for minutes, and a time limit that
#          cuts a bench off loses its whole table
#   onnx   the ONNX Runtime CUDA and TensorRT providers (onnxruntime-gpu from .whl): conformance, then a bench
#   all    `linnet bench --all --profile gpu-small` on the Qwen2.5-0.5B shapes: every row the machine can run,
#          two minutes each at most, into $OUT/results (a site renders it: `linnet site $OUT/results -o site`).
#          The serving rows need a tokenizer: put the default model's tokenizer.json and tokenizer_config.json
#          in .tokenizer/ (untracked, carried to the machine), else they are recorded as not run.
# Each stage fits one device call of 10 minutes, and the default pair fits one of 590 s (240 + 320 s at
# most, TEST_SECONDS and BENCH_SECONDS); on a warm machine the next call can run the next stage.
# Runs with that machine's own python3 and packages; .whl holds what it lacks (gguf, ml_dtypes). Logs go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site LINNET_CACHE=/tmp/linnet-cache
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  nproc; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

tests() {  # one process per checkpoint case (compiling is the slow part), all in parallel
  local pids=()
  for case in llama-gqa3 llama-mqa-tied-rope3 qwen2-tied qwen3-gqa3 qwen3-mqa-tied; do
    timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider tests/backends/test_conformance.py \
      -k "$case" > "$OUT/conformance-$case.log" 2>&1 & pids+=($!)
  done
  timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider tests/backends/torch tests/bench \
    tests/generation > "$OUT/other-tests.log" 2>&1 & pids+=($!)
  wait "${pids[@]}"
  tail -n 1 "$OUT"/*.log
}

checkpoint() {
  [ -f /tmp/qwen05b/config.json ] || python3 scripts/shaped_checkpoint.py qwen2.5-0.5b-instruct -o /tmp/qwen05b \
    --dtype bf16 --no-tokenizer
  if [ -f .tokenizer/tokenizer.json ]; then cp .tokenizer/tokenizer*.json /tmp/qwen05b/; fi
}

run_bench() {  # name, then the subjects
  local name=$1; shift
  checkpoint
  timeout "${BENCH_SECONDS:-320}" python3 -m linnet bench /tmp/qwen05b --dtype bf16 --prompt-tokens 512 \
    --new-tokens 128 --warmup 1 --runs 3 "$@" -o "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
}

onnx_gpu() {  # the CUDA and TensorRT providers: parity in every dtype, then decode speed beside torch's
  # needs onnxruntime-gpu in place of onnxruntime (a wheel in .whl, installed above)
  timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
    tests/backends/test_conformance.py tests/backends/test_step.py -k "onnx:cuda or onnx:tensorrt" \
    > "$OUT/onnx-gpu-tests.log" 2>&1; tail -n 3 "$OUT/onnx-gpu-tests.log"
  run_bench bench-bf16-onnx --backend onnx:cuda --backend onnx:tensorrt --backend torch:cudagraphs --peer transformers
}

stages=("$@"); [ ${#stages[@]} -gt 0 ] || stages=(tests bench)
for stage in "${stages[@]}"; do
  case $stage in
    tests) tests ;;
    bench) run_bench bench-bf16 --backend torch:eager --backend torch:inductor --backend torch:cudagraphs \
             --peer transformers ;;
    peer) run_bench bench-bf16-compiled-peer --backend torch:cudagraphs --peer transformers:compiled ;;
    onnx) onnx_gpu ;;
    all) checkpoint  # a second call resumes the first's results file
         resume=(); if ls "$OUT"/results/*.json > /dev/null 2>&1; then resume=(--resume); fi
         timeout "${ALL_SECONDS:-570}" python3 -m linnet bench /tmp/qwen05b --all --profile gpu-small --dtype bf16 \
           --time-limit 120 "${resume[@]}" -o "$OUT/results" 2>&1 | tail -n 40 ;;
    *) echo "unknown stage $stage (tests, bench, peer, onnx, all)"; exit 2 ;;
  esac
done
