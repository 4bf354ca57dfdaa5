#!/usr/bin/env bash
# One H200 call of GPU checks for this wave, run from a clean export of the commit (.gpu_carry/src.tar,
# `git archive --prefix=src/ HEAD`), so that uncommitted work in the checkout cannot leak in:
#   GPU tests of packed documents, per-layer budgets and the sparse Triton kernels;
#   the float32 head_dim-128 first step; the 128K standard sparse workload. (Run at bbb3fcd it also ran
#   the tests and a 128K bench of sparse_unselected="page_means", since removed: no gain, +40 % time.)
# Also keeps the first half of the real model's GGUF (.gpu_carry/gguf.part00) for the next call.
# Usage (device tool, carry [".gpu_carry"]): bash benchmarks/gpu/wave_checks.sh
set -u
ROOT=$PWD
FINAL=$OUT; OUT=/tmp/checks; rm -rf $OUT; mkdir -p $OUT  # one archive comes back (the device returns 8 files)
mkdir -p /tmp/keep && cp -n .gpu_carry/gguf.part* /tmp/keep/ 2>/dev/null
rm -rf /tmp/src && tar -xf .gpu_carry/src.tar -C /tmp && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src PYTHONUNBUFFERED=1 OOMB_GIT_COMMIT=${OOMB_GIT_COMMIT:-unknown}
TAIL=6
source benchmarks/gpu/run_step.sh  # run SECONDS NAME COMMAND...
run 240 gpu_tests python -m pytest -q -m gpu -p no:cacheprovider tests/test_documents.py \
    tests/test_calibrate.py tests/test_triton_sparse.py
run 90 fp32_first_step python benchmarks/fp32_first_step.py
B=(python -m oomb bench --modes sparse --contexts 128K --backend cudnn --query-block-pages 32 --sparse-budget 32
   --no-checkpoint-layers --kv-grad-dtype bf16 --out-dir "$OUT")
run 110 bench_drop "${B[@]}" --name sparse_drop_128k
cd "$ROOT"
tar -czf "$FINAL/checks.tar.gz" -C /tmp checks
