#!/usr/bin/env bash
# GPU checks of the chooser and the default backend (one H200 call, < 10 minutes in all):
#     bash benchmarks/autoconfig_gpu.sh
# 1. float32 on CUDA: a 2-layer 8K model's first step with the pruned float32 Triton configs
#    (was 113 s with full autotuning); a head_dim 128 float32 model too (the first config must compile).
# 2. oomb train's chosen plan and first-step vs steady step time: Qwen2.5-0.5B at 128K (cudnn, pages on
#    the GPU) and Qwen2.5-7B LoRA at 128K.
# 3. oomb plan on the detected GPU at 1M: the chosen configuration for this machine's free memory.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
export OOMB_GIT_COMMIT=${OOMB_GIT_COMMIT:-unknown}
TAIL=12
source benchmarks/gpu/run_step.sh  # run SECONDS NAME COMMAND...
common=(--steps 3 --set logging.progress=false --set checkpoint.export=false --set checkpoint.every=0)
run 110 fp32_tiny python -m oomb train --seq-len 8K --set model.dtype=float32 --output-dir /tmp/r1 "${common[@]}"
run 80 fp32_d128 python benchmarks/fp32_first_step.py
run 50 plan_1m python -m oomb plan --model qwen2.5-7b --context 1M --lora-rank 16
run 140 qwen05b_128k python -m oomb train --set model.preset=qwen2.5-0.5b --seq-len 128K --output-dir /tmp/r2 \
    "${common[@]}"
run 190 qwen7b_lora_128k python -m oomb train --set model.preset=qwen2.5-7b --lora --seq-len 128K --steps 2 \
    --output-dir /tmp/r3 --set logging.progress=false --set checkpoint.export=false --set checkpoint.every=0
