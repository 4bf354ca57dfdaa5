#!/usr/bin/env bash
# Issue 18, item 1 on the H200: gradients of the real model (SmolLM2-135M, 8,192 tokens of real text,
# fp32) under sparse attention with the summary score (minmax) and with the exact oracle score (the
# true attention mass, oomb/sparse.py exact_block_scores), max and softmax pooling, at pages of 64, 32
# and 16 tokens, budgets chosen for <= 25 % of the history read (and a curve at 64). JSON into $OUT.
# Needs the real model's GGUF halves (benchmarks/gpu/real_model_setup.sh).
#   run (device tool, carry [".gpu_carry/gguf.part01", ".gpu_carry/whl"] after a call that kept part00):
#   bash benchmarks/gpu/sparse_oracle.sh
source benchmarks/gpu/real_model_setup.sh
export PYTHONUNBUFFERED=1 OOMB_TRITON_AUTOTUNE=0 OOMB_GIT_COMMIT=${OOMB_GIT_COMMIT:-unknown}
G="-m oomb gradcheck --model smollm2 --text python-docs --dtype float32 --device cuda --hf off --seq-len 8192 --chunk-size 1024"
timeout 200 python3 $G --page-size 64 --budgets 8 15 24 32 48 --scores minmax exact --poolings max softmax \
    --json $OUT/oracle_p64.json 2>&1 | grep -v Loading | tail -40
timeout 90 python3 $G --page-size 32 --budgets 30 --scores minmax exact --poolings max softmax \
    --json $OUT/oracle_p32.json 2>&1 | grep -v Loading | tail -8
timeout 90 python3 $G --page-size 16 --budgets 60 --scores minmax exact --poolings max softmax \
    --json $OUT/oracle_p16.json 2>&1 | grep -v Loading | tail -8
