#!/usr/bin/env bash
# OOMBSFTTrainer (examples/sft_trainer.py: TRL's SFTTrainer with the one-line switch) vs `oomb train` on the
# GPU machine, same settings (benchmarks/sft_trainer_vs_train.py says which and how it times them):
#
#     bash benchmarks/sft_trainer_h200.sh                                          # 7B preset, LoRA, 128K, 3 steps
#   arguments: [PRESET [SEQ_LEN [sft_trainer_vs_train.py flags...]]], e.g. tiny-qwen2 2048 --train-set oomb.chunk_size=512
#
# A GPU machine without network may lack trl/datasets: when `import trl, datasets` fails, wheels in $WHEELS
# (`pip download trl datasets` elsewhere) are installed into $SITE (default /tmp/site; --no-deps), put first on PYTHONPATH. Results JSON and the two
# arms' logs go to $OUT (default out/sft_vs_train); data, runs and caches to /tmp/oomb_sft_vs_train.
# On the H200: ~7 minutes (each arm: ~30 s start and 7B random init, then 54.5 + 2 x 49.3 s of steps).
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${1:-qwen2.5-7b}; SEQ=${2:-131072}; shift $(( $# < 2 ? $# : 2 ))
PYTHON=${PYTHON:-python3}
export OUT=${OUT:-out/sft_vs_train}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl/hf_trainer_gpu}; SITE=${SITE:-/tmp/site}
if ! "$PYTHON" -c "import trl, datasets" 2>/dev/null; then
    ls "$WHEELS"/*.whl >/dev/null || { echo "no trl/datasets here and no wheels in $WHEELS" >&2; exit 2; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
"$PYTHON" -c "import trl, datasets, pyarrow; print('trl', trl.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
export OOMB_BENCH_COMMAND="bash benchmarks/sft_trainer_h200.sh $PRESET $SEQ${*:+ $*}"
exec "$PYTHON" benchmarks/sft_trainer_vs_train.py --preset "$PRESET" --seq-len "$SEQ" --steps 3 "$@"
