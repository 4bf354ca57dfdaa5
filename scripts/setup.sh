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
if [ -n "${TRANSFORMERS:-}" ]; then
    "$PY" -m pip install -q "transformers==${TRANSFORMERS}"
fi
"$PY" -c "import torch, transformers, peft; print(f'oomb env: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')"
