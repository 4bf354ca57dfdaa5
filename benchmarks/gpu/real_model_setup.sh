#!/usr/bin/env bash
# On the GPU machine: install the carried gguf wheel, reassemble the carried GGUF halves (one call
# carries at most 64 MiB) and convert SmolLM2-135M once (oomb/real_model.py). Source it:
#   source benchmarks/gpu/real_model_setup.sh      (after two calls carried .gpu_carry/gguf.part00, part01)
set -e
mkdir -p /tmp/keep
for part in .gpu_carry/gguf.part*; do [ -f "$part" ] && cp -n "$part" /tmp/keep/; done
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu_carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
cat /tmp/keep/gguf.part00 /tmp/keep/gguf.part01 > /tmp/keep/SmolLM2-135M-Instruct.Q4_1.gguf
export OOMB_SMOLLM2_GGUF=/tmp/keep/SmolLM2-135M-Instruct.Q4_1.gguf OOMB_CACHE=/tmp/keep/cache
python3 -c "from oomb.real_model import smollm2_dir; print('real model at', smollm2_dir())"
set +e
