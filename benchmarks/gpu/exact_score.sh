#!/usr/bin/env bash
# H200 checks of the exact sparse score's Triton kernel, run from a clean export of the commit
# (.gpu_carry/src.tar, `git archive --prefix=src/ HEAD`):
#   its GPU tests, the per-call scoring cost (benchmarks/sparse_score_speed.py) and 128K steps of the
#   7B shape's standard workload with the exact, rerank and minmax scores.
# Usage (device tool, carry [".gpu_carry"]): bash benchmarks/gpu/exact_score.sh [PART...]
#   PART: tests, speed, minmax, exact, rerank, rerank2, rerank_1m, exact_g32, minmax_g32 (default: tests speed minmax exact)
set -u
ROOT=$PWD
mkdir -p /tmp/keep && cp -n .gpu_carry/gguf.part* /tmp/keep/ 2>/dev/null  # a real-model half, for the next call
FINAL=$OUT; OUT=/tmp/checks; rm -rf $OUT; mkdir -p $OUT  # one archive comes back
rm -rf /tmp/src && tar -xf .gpu_carry/src.tar -C /tmp && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src PYTHONUNBUFFERED=1
TAIL=8
source benchmarks/gpu/run_step.sh  # run SECONDS NAME COMMAND...
B=(python -m oomb bench --modes sparse --contexts 128K --backend cudnn --kv-grad-dtype bf16 --out-dir "$OUT")
for part in "${@:-tests speed minmax exact}"; do
  for p in $part; do
    case $p in
      tests) run 150 gpu_tests python -m pytest -q -p no:cacheprovider tests/test_triton_scores.py \
                 tests/test_sparse.py -k "exact or scores or kernel" ;;
      speed) run 150 speed python benchmarks/sparse_score_speed.py --out "$OUT/sparse_score_speed_h200.json" ;;
      minmax) run 150 bench_minmax "${B[@]}" --sparse-score minmax --name sparse_minmax_128k ;;
      exact) run 150 bench_exact "${B[@]}" --sparse-score exact --name sparse_exact_128k ;;
      minmax_g32) run 150 bench_minmax_g32 "${B[@]}" --sparse-score minmax --query-block-pages 32 \
                      --name sparse_minmax_g32_128k ;;
      rerank) run 150 bench_rerank "${B[@]}" --sparse-score rerank --name sparse_rerank_128k ;;
      rerank2) run 150 bench_rerank2 "${B[@]}" --sparse-score rerank --sparse-rerank-factor 2 \
                   --name sparse_rerank2_128k ;;
      rerank_1m) run 560 bench_rerank_1m python -m oomb bench --modes sparse+offload --contexts 1M \
                     --query-block-pages 32 --kv-grad-dtype bf16 --sparse-score rerank --progress \
                     --out-dir "$OUT" --name sparse_offload_rerank_1m ;;
      exact_g32) run 150 bench_exact_g32 "${B[@]}" --sparse-score exact --query-block-pages 32 \
                     --name sparse_exact_g32_128k ;;
    esac
  done
done
cd "$ROOT"
tar -czf "$FINAL/checks.tar.gz" -C /tmp checks
