#!/usr/bin/env bash
# examples/sft_trainer.py on the GPU machine: TRL's SFTTrainer plain vs through oomb (one line changed),
# random weights of a preset shape, LoRA, long synthetic chats; JSON summaries (losses, step times, peak
# GPU memory) and logs go to $OUT (or ./out/sft_h200).
#
#   run (device tool), carry [".whl/hf_trainer_gpu"]:  bash benchmarks/sft_trainer_h200.sh qwen2.5-0.5b 16384 both
#   arguments: PRESET SEQ_LEN {both|oomb|plain} [extra examples/sft_trainer.py flags]
# The GPU machine has no trl/datasets: the wheels (trl 1.16.0, datasets 5.2.0, dill, multiprocess,
# xxhash, pandas; 14 MB) come in .whl/hf_trainer_gpu (pip download ... --python-version 3.12 --no-deps).
set -euo pipefail
PRESET=${1:-qwen2.5-0.5b}; SEQ=${2:-16384}; WHICH=${3:-both}; shift $(( $# < 3 ? $# : 3 )) || true
OUT=${OUT:-out/sft_h200}; mkdir -p "$OUT"
python -c "import trl" 2>/dev/null || python -m pip install -q --no-deps .whl/hf_trainer_gpu/*.whl
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DATA=$OUT/chats.jsonl
python - "$DATA" "$SEQ" <<'PY'
import json, sys
from oomb.real_model import english_text
text, n = english_text(), int(sys.argv[2])  # the byte tokenizer: one token per byte
with open(sys.argv[1], "w") as f:
    for i in range(8):
        part = text[(i * n) % (len(text) - n):][: n + 200]
        f.write(json.dumps({"messages": [{"role": "user", "content": "Continue: " + part[:200]},
                                         {"role": "assistant", "content": part[200:]}]}) + "\n")
PY
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1 || true
for trainer in plain oomb; do
  [[ $WHICH == both || $WHICH == "$trainer" ]] || continue
  flag=""; [[ $trainer == plain ]] && flag="--plain"
  python examples/sft_trainer.py --preset "$PRESET" --data "$DATA" --seq-len "$SEQ" --lora --max-steps 3 --lr 1e-4 \
    --output-dir "$OUT/run_$trainer" $flag "$@" > "$OUT/${trainer}_${PRESET}_${SEQ}.log" 2>&1 || echo "$trainer failed (see log)"
  grep '^{"trainer' "$OUT/${trainer}_${PRESET}_${SEQ}.log" || tail -20 "$OUT/${trainer}_${PRESET}_${SEQ}.log"
done
