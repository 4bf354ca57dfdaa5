#!/usr/bin/env bash
# H200 checks of issue 22 (model families on the Triton kernels: sliding windows, attention sinks, logit
# softcapping), run from a clean export of the commit (.gpu_carry/src.tar, `git archive --prefix=src/ HEAD`).
# Usage (device tool, carry [".gpu_carry"]): bash benchmarks/gpu/families.sh [PART...]
#   tests      the GPU tests of windows, sinks and softcap on triton in tests/test_families.py (gemma2,
#              gemma3_text, gpt_oss, mistral steps vs the torch backend and HF; gemma2 bf16 dense and sparse)
#   softcap_tests  the softcap kernel tests of tests/test_triton_paged.py and tests/test_triton_sparse.py
#              (bf16 within 2x the reference's error, fp32 vs the reference, bit-identical repeats)
#              Both test parts pin one config per kernel (OOMB_TRITON_AUTOTUNE=0): a third of the compiles.
#   kernels    the GPU tests of the three kernel files whole, autotuned (regression: head dims <= 128 compile
#              as before)
#   kernel     benchmarks/attention.py --softcap 50: the capped kernels' cost over the plain ones, at Gemma 2's
#              attention shape (16 / 8 heads x 256: the wide-tile configs of head dims > 128 get tuned) and at
#              the 7B shape (28 / 4 x 128)
#   hybrid     gemma-3-12b (40 window layers of 1024, 8 global; head dim 256) at 128K, dense+offload and
#              sparse+offload, backend auto (= triton: cudnn cannot mask windows)
#   softcap    gemma-2-9b (21 softcapped window layers of 4096, 21 softcapped global) at 128K, dense on triton
#   dense7b    qwen2.5-7b at 128K, dense on triton, the same flags: what the hybrids compare to
#   cudnn_tests  the GPU tests of the cuDNN band path (sliding windows, sinks: tests/test_cudnn_windows.py) and of
#              the cuDNN sparse path
#   gptoss     gpt-oss-20b (12 window layers of 128 with sinks, 12 global; MoE) at 128K, dense and sparse, backend
#              auto (cudnn: windows on the band path)
#   gptoss_dense  gpt-oss-20b at 128K, dense only (with hybrid_1m in one call: LIMIT_1M=390 bash ... "hybrid_1m
#              gptoss_dense")
#   hybrid_1m  gpt-oss-20b at 1M, sparse+offload (the one hybrid preset whose pages fit the host at 1M), auto;
#              --progress: a run cut by the limit still shows its chunk rate in the log
# Default: tests. Each call of the device tool has 600 s and the limits below add up per call: give
# tests | softcap_tests | kernels | kernel | hybrid | softcap dense7b | gptoss | hybrid_1m, one group per call.
#
# Predicted memory (oomb plan --gpu-gib 139 --host-gib 125 --optimizer none --no-fp32-grad-accumulation
# --kv-grad-dtype bfloat16, i.e. bench's defaults plus bf16 page gradients; usable: GPU 131.5, host 118.8 GiB;
# without offload window layers keep only their chunks' tails, with offload every page on the host):
#   gemma-3-12b 128K: dense 88.64 GiB GPU, dense+offload 52.39 GPU / 98.00 host, sparse+offload 55.01 / 98.10;
#                     with fp32 page gradients offload needs 146 GiB host (no), dense 107.60 GPU (fits).
#                     1M: nothing fits (K+V alone 384 GiB: 384 KiB per token); the largest is 288K dense,
#                     159K with offload.
#   gemma-2-9b  128K: dense 124.79 GPU / 2.00 host (tight), dense+offload 42.41 / 86.00.
#   qwen2.5-7b  128K: dense 46.67 GPU.
#   gpt-oss-20b 128K: dense 89.07 GPU, sparse 89.14 GPU.
#               1M:   sparse+offload 90.93 GPU / 98.38 host, dense+offload 83.11 / 98.00 (dense attention over
#                     1M tokens would take far longer than the 600 s a call has).
# With offload a window layer stages only the pages its chunk's window overlaps, in stage 1 and both calls of
# stage 2, and writes back only their dK/dV (docs/models.md "Sliding windows"): gpt-oss-20b's 12 window
# layers (W = 128, page 128) stage 1 history page per chunk and layer (12 x 256 KiB of K+V per chunk at any
# context) instead of 24 KiB per history token per chunk, which was about 3 TiB per stage at 1M (about 60 s
# at 55 GB/s in stage 1, three times that in stage 2 with the gradient pages). The global layers' staging
# (dense+offload: every history page of each of them, per chunk) is unchanged.
set -u
ROOT=$PWD
FINAL=$OUT; OUT=/tmp/checks; rm -rf $OUT; mkdir -p $OUT  # one archive comes back
rm -rf /tmp/src && tar -xf .gpu_carry/src.tar -C /tmp && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src PYTHONUNBUFFERED=1 OOMB_GIT_COMMIT=${OOMB_GIT_COMMIT:-unknown}  # the archive's commit
TAIL=${TAIL:-12}
source benchmarks/gpu/run_step.sh  # run SECONDS NAME COMMAND...
T=(python -m pytest -q -s -m gpu -p no:cacheprovider)
PINNED=(env OOMB_TRITON_AUTOTUNE=0 "${T[@]}")
B=(python -m oomb bench --kv-grad-dtype bf16 --out-dir "$OUT")
for part in "${@:-tests}"; do
  for p in $part; do
    case $p in
      tests) run 540 gpu_family_tests "${PINNED[@]}" tests/test_families.py ;;
      softcap_tests) run 540 gpu_softcap_tests "${PINNED[@]}" tests/test_triton_paged.py tests/test_triton_sparse.py \
                         -k softcap ;;
      kernels) run 540 gpu_kernel_tests "${T[@]}" tests/test_triton_paged.py tests/test_triton_sparse.py \
                   tests/test_key_windows.py ;;
      kernel)
        run 300 attention_gemma2 python benchmarks/attention.py --histories 32768 131072 --heads 16 --kv-heads 8 \
            --head-dim 256 --softcap 50
        cp "$OUT/attention.json" "$OUT/attention_softcap_d256_h200.json" 2>/dev/null
        run 200 attention_7b python benchmarks/attention.py --histories 131072 --softcap 50
        cp "$OUT/attention.json" "$OUT/attention_softcap_d128_h200.json" 2>/dev/null ;;
      hybrid) run 540 bench_gemma3 "${B[@]}" --preset gemma-3-12b --contexts 128K --modes dense+offload sparse+offload \
                  --name gemma3_12b_128k ;;
      softcap) run 270 bench_gemma2 "${B[@]}" --preset gemma-2-9b --contexts 128K --modes dense --backend triton \
                   --name gemma2_9b_128k ;;
      dense7b) run 240 bench_7b "${B[@]}" --preset qwen2.5-7b --contexts 128K --modes dense --backend triton \
                   --name qwen7b_triton_128k ;;
      cudnn_tests) run 300 gpu_cudnn_window_tests "${T[@]}" tests/test_cudnn_windows.py tests/test_cudnn_sparse.py \
                       tests/test_cudnn_paged.py -k "band or window or sparse or selected" ;;
      gptoss) run 480 bench_gptoss "${B[@]}" --preset gpt-oss-20b --contexts 128K --modes dense sparse \
                  --progress --name gptoss_20b_128k ;;
      gptoss_dense) run 170 bench_gptoss_dense "${B[@]}" --preset gpt-oss-20b --contexts 128K --modes dense \
                        --progress --name gptoss_20b_dense_128k ;;
      hybrid_1m) run ${LIMIT_1M:-560} bench_gptoss_1m "${B[@]}" --preset gpt-oss-20b --contexts 1M --modes sparse+offload \
                     --query-block-pages 32 --progress --name gptoss_20b_sparse_offload_1m ;;
      *) echo "unknown part $p" ;;
    esac
  done
done
cd "$ROOT"
tar -czf "$FINAL/checks.tar.gz" -C /tmp checks
