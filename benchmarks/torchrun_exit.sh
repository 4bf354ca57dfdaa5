#!/usr/bin/env bash
# How often `oomb train --tp 2` under torchrun (2 CPU processes, gloo) fails after the run itself
# finished: the test tests/test_parallel.py::test_oomb_train_under_torchrun_matches_one_process runs
# this command once. Before Trainer.close() one rank sometimes aborted at interpreter exit
# ("terminate called without an active exception", SIGABRT) because the gloo process group was never
# destroyed. Prints one line per run; keeps the output of failed runs in /tmp/torchrun_exit_N.*
#
#     bash benchmarks/torchrun_exit.sh 40 > benchmarks/results/logs/torchrun_exit_after_fix_2026-11-30.log
set -u
runs=${1:-25}
python=${PYTHON:-python}
for i in $(seq 1 "$runs"); do
    out=/tmp/torchrun_exit_$i
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD timeout 300 "$python" -m torch.distributed.run --nproc-per-node 2 \
        --master-port $((29600 + i)) -m oomb.cli train --tp 2 --output-dir "$out" --steps 2 --seq-len 1024 \
        --set logging.progress=false --set oomb.chunk_size=256 --set optim.eps=1e-3 >"$out.out" 2>"$out.err"
    rc=$?
    echo "run $i rc $rc"
    [ "$rc" -eq 0 ] && rm -rf "$out" "$out.out" "$out.err"
done
