#!/usr/bin/env bash
# The GPU figures of issue 39 in one call on a GPU machine (one H100, torch with CUDA, no package registry):
# installs the carried wheels (megatron-core's cp312 wheel and whatever else the machine lacks, in .whl/,
# fetched as /work/.library/device/README.md says), runs tests/test_cuda.py, then benchmarks/overhead.py
# at --sizes 1b with the incident section (its time and its operators), and writes the log, the JSON and
# the tables under $OUT (default: ./gpu-check-out).
#   device run, carry [".whl"]:  bash benchmarks/gpu_check.sh
set -o pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c \
  "import torch, megatron.core; print(torch.__version__, megatron.core.__version__)"; } 2>&1 | tee "$OUT/machine.txt"
python3 -m pytest tests/test_cuda.py -q 2>&1 | tee "$OUT/test_cuda.log"
tests=$?
python3 benchmarks/overhead.py --sizes 1b --rounds 5 --scan-reps 5 --incident 2 \
    --json "$OUT/overhead-1b.json" 2>&1 | tee "$OUT/overhead-1b.log"
bench=$?
echo "test_cuda: exit $tests; overhead --sizes 1b: exit $bench" | tee -a "$OUT/machine.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
