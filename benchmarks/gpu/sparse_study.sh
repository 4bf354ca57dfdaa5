#!/usr/bin/env bash
# The sparse-fidelity study on the H200 (real weights): recall per layer and KV head for every
# selection rule and the oracle, then gradient cosine vs dense for a grid of rules (fp32).
# Writes JSON into $OUT. Usage: bash benchmarks/gpu/sparse_study.sh
source benchmarks/gpu/real_model_setup.sh
export PYTHONUNBUFFERED=1 OOMB_TRITON_AUTOTUNE=0 OOMB_GIT_COMMIT=${OOMB_GIT_COMMIT:-unknown}
R="benchmarks/sparse_recall.py --arms minmax/max mean/max minmax/softmax mean/softmax oracle"
timeout 120 python3 $R --seq-len 8192 --chunk-size 1024 --page-size 64 --budgets 4 8 16 32 \
    --out $OUT/recall_8k.json 2>&1 | grep -v Loading
timeout 150 python3 $R --seq-len 32768 --yarn 4 --chunk-size 4096 --page-size 128 --budgets 8 16 32 64 \
    --out $OUT/recall_32k_yarn.json 2>&1 | grep -v Loading
G="-m oomb gradcheck --model smollm2 --text python-docs --dtype float32 --device cuda"
timeout 200 python3 $G --seq-len 8192 --chunk-size 1024 --page-size 64 --budgets 4 8 16 --scores minmax mean \
    --poolings max softmax --json $OUT/gradcheck_8k.json 2>&1 | grep -v Loading | tail -45
timeout 100 python3 $G --seq-len 8192 --chunk-size 1024 --page-size 64 --budgets 4 8 16 --scores minmax \
    --poolings softmax --leak-free --hf off --json $OUT/gradcheck_8k_leakfree.json 2>&1 \
    | grep -v Loading | tail -12
C="-m oomb calibrate --model smollm2 --text python-docs --device cuda --max-read 0.25"
timeout 90 python3 $C --seq-len 8192 --chunk-size 1024 --page-size 64 --grid 2 4 8 16 32 --out $OUT/plan_8k.yaml 2>&1 | grep -v Loading | tail -3
timeout 60 python3 $G --seq-len 8192 --chunk-size 1024 --page-size 64 --sparse-plan $OUT/plan_8k.yaml --scores minmax --poolings softmax --hf off --json $OUT/gradcheck_8k_plan.json 2>&1 | grep -v Loading | tail -6
timeout 120 python3 $C --seq-len 32768 --yarn 4 --chunk-size 4096 --page-size 128 --grid 4 8 16 32 64 --out $OUT/plan_32k.yaml 2>&1 | grep -v Loading | tail -3
timeout 150 python3 $G --seq-len 32768 --yarn 4 --chunk-size 4096 --page-size 128 --sparse-plan $OUT/plan_32k.yaml --scores minmax --poolings softmax --hf off --json $OUT/gradcheck_32k_plan.json 2>&1 | grep -v Loading | tail -6
