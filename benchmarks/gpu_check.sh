#!/usr/bin/env bash
# The GPU figures (issues 39 and 53) in one call on a GPU machine (one H100, Python 3.12, torch with CUDA,
# no package registry). gradnan is installed as the README says (editable, no dependencies fetched: the
# machine has them), with megatron-core's cp312 wheel carried in .whl/ (fetched as
# /work/.library/device/README.md says). Then, each under its own time limit, so that one overrun leaves
# the rest's figures:
#   0. benchmarks/segment_reduce.py (the exact counts' segmented reductions, one segment against pieces);
#   1. benchmarks/overhead.py at --sizes 1b: the healthy step per mode (Megatron's own check_for_nan_in_grad
#      beside it), the scan against the floor with its kernel profile, the replica check, a checkpoint
#      save against its mark, and the incident in time and operators;
#   2. tests/test_cuda.py (the same answers on the GPU as on the CPU, no added host sync, bitwise identity,
#      the bundle compared with --against on CUDA and on the CPU);
#   3. that bundle's --against comparison as a user reads it, replayed on the CPU and on the GPU.
# Everything lands under $OUT (default: ./gpu-check-out): machine.txt, the logs, overhead-1b.json.
#   device run, carry [".whl"]:  bash benchmarks/gpu_check.sh
set -o pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    cat "$OUT/install.log"; exit 2; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c \
  "import sys, torch, megatron.core; print(sys.version.split()[0], torch.__version__, megatron.core.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"
timeout 60 python3 benchmarks/segment_reduce.py 2>&1 | tee "$OUT/segment_reduce.log"
timeout "${BENCH_SECONDS:-290}" python3 benchmarks/overhead.py --sizes "${SIZES:-1b}" --rounds "${ROUNDS:-7}" --scan-reps 5 \
    --checkpoint-reps 3 --incident 2 --json "$OUT/overhead-1b.json" 2>&1 | tee "$OUT/overhead-1b.log"
bench=$?
rm -rf /tmp/gpu-pytest
timeout "${TEST_SECONDS:-170}" python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider \
    --basetemp=/tmp/gpu-pytest 2>&1 | tee "$OUT/test_cuda.log"
tests=$?
bundle=$(find /tmp/gpu-pytest -path '*/cuda/overflow_fp16/bundles/rank00000_*' -mindepth 1 -maxdepth 7 \
    -type d -name 'step*' 2>/dev/null | sort | head -1)
against=1
if [ -n "$bundle" ]; then
    { for device in cpu cuda; do
          timeout 60 python3 -m gradnan replay "$bundle" --device "$device" --against "$(command -v python3)"
      done; } > "$OUT/replay-against.txt" 2>&1
    against=$?
fi
echo "overhead --sizes 1b: exit $bench; test_cuda: exit $tests; replay --against: exit $against" \
    | tee -a "$OUT/machine.txt"
[ "$bench" -eq 0 ] && [ "$tests" -eq 0 ] && [ "$against" -eq 0 ]
