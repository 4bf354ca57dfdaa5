#!/usr/bin/env bash
# The wheels that examples/sft_trainer.py needs on the GPU machine, which has torch, transformers, peft and
# accelerate but no trl or datasets (and may hold an older pyarrow than datasets wants); nothing can be
# downloaded there, so they travel in the device call's carry (64 MiB with the working tree):
#
#   bash benchmarks/hf_trainer_wheels.sh                       # -> .whl/hf_trainer_gpu (cp312, x86_64), 46 MiB
#   bash benchmarks/hf_trainer_wheels.sh /tmp/whl311 3.11      # the same set for another Python (a CPU test)
#
# Installed there with: pip install --no-index --no-deps --target /tmp/site DIR/*.whl; PYTHONPATH=/tmp/site
# (benchmarks/sft_trainer_h200.sh does it). trl 1.16.0 and datasets 5.2.0 are the versions
# tests/test_hf_trainer.py passes with (docs/trainer_integration.md). datasets needs pyarrow >= 24, pandas,
# dill < 0.4.2, multiprocess < 0.70.20, xxhash and fsspec <= 2026.9.0 (carried in case the image's is newer);
# the rest (numpy, huggingface_hub, psutil, python-dateutil, ...) is on the GPU image. The pyarrow wheel
# alone is 55 MB, which with the others would pass the carry limit: it is rewritten without what neither
# datasets nor TRL loads (Arrow Flight, the S3 filesystem library, which libarrow opens only for s3://
# paths, tests, C++ headers, Cython sources, and the two link-time copies of libarrow_python): 55 -> 34 MB.
# When DIR's Python version is the running one, the script installs the set into a temporary folder and
# checks `import pyarrow.parquet, datasets, trl` and a json load_dataset with it.
set -euo pipefail
DIR=${1:-.whl/hf_trainer_gpu}
PY=${2:-3.12}
PYTHON=${PYTHON:-python3}
PINS=(trl==1.16.0 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
      fsspec==2026.9.0)
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DIR" "${PINS[@]}"
"$PYTHON" - "$DIR" <<'PY'
import base64, glob, hashlib, os, re, sys, zipfile

(src,) = glob.glob(os.path.join(sys.argv[1], "pyarrow-*.whl"))
drop = re.compile(r"pyarrow/(tests/|include/|src/|includes/|.*\.(pyx|pxd|pxi)$|.*flight.*|libarrow_s3\.so"
                  r"|libarrow_python(_parquet_encryption)?\.so(\.\d+\.\d+\.\d+)?$|_pyarrow_cpp_tests\.)")
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    kept, record = [], None
    for info in zin.infolist():
        if info.filename.endswith(".dist-info/RECORD"):
            record = info
        elif not drop.match(info.filename):
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            kept.append(f"{info.filename},sha256={digest},{len(data)}")
    zout.writestr(record, "\n".join(kept + [f"{record.filename},,"]) + "\n")
os.replace(tmp, src)
PY
ls -l "$DIR"
du -cb "$DIR"/*.whl | tail -n 1 | awk '{printf "total %.1f MiB\n", $1 / 2^20}'
if [[ $("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') == "$PY" ]]; then
    site=$(mktemp -d)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$DIR"/*.whl
    PYTHONPATH=$site HF_HOME=$site/hf HF_HUB_OFFLINE=1 "$PYTHON" - "$site" <<'PY'
import json, os, sys
import pyarrow, pyarrow.parquet, datasets, trl
assert pyarrow.__file__.startswith(sys.argv[1]), pyarrow.__file__
path = os.path.join(sys.argv[1], "rows.jsonl")
with open(path, "w") as f:
    f.write(json.dumps({"text": "hello"}) + "\n")
print("check: pyarrow", pyarrow.__version__, "datasets", datasets.__version__, "trl", trl.__version__,
      "load_dataset rows:", len(datasets.load_dataset("json", data_files=path, split="train")))
PY
    rm -rf "$site"
fi
