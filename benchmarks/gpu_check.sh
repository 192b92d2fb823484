#!/usr/bin/env bash
# One prepared run for a machine with a CUDA device (issue 17, "The GPU path").
# Budgeted for about 6 minutes on one GPU; every step runs even if one fails,
# and everything goes to stdout and to ${OUT:-/tmp/gpu_check}/.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# 1. the tests that only run with CUDA (skipped on CPU), and the side-stream
#    copy path's CPU-model tests, for comparison;
# 2. benchmarks/gpu_check.py: the engine on cuda against transformers, the
#    omni pipeline on cuda against cpu with synchronizing calls counted per
#    thinker step, device-to-host copy bandwidth (blocking, HostCopier, raw);
# 3. the tensor-prefix-cache ops benchmark (host cache, pinned on a CUDA machine).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
status=0

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"

step cuda_tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/worker/test_host_copy.py \
  "tests/attention/test_paged_attention.py::test_prefill_chunk_and_decode_on_cuda" \
  "tests/worker/test_tensor_prefix_cache.py::test_device_inputs_are_cached_and_merged_on_cpu" \
  "tests/conformance/test_prefix_cache.py::test_update_rejects_gpu_hidden_states_cpu" \
  tests/engine/omni/test_omni_host_copy.py
step gpu_check 300 "$PY" benchmarks/gpu_check.py
step cache_ops 120 "$PY" benchmarks/bench_cache_ops.py --quick

echo "gpu_check.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL); logs in $OUT"
exit $status
