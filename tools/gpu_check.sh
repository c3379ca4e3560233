#!/usr/bin/env bash
# What to run on a machine with a GPU (the suite's CUDA paths for real), in one go:
#   bash tools/gpu_check.sh [OUT_DIR]
# 1. builds the C fast path in place and installs any wheels in ./.whl (packages the
#    machine lacks, for its Python) into a scratch folder;
# 2. tests/test_cuda.py, verbose, CUDA_PROCESSES processes (0: one at a time, for the GPU
#    is shared by all of them: six at once stretched its event timings and its memory);
# 3. the rest of the suite with a GPU present, SUITE_PROCESSES processes (4; pytest-xdist,
#    if installed; SUITE_TIMEOUT=0 leaves it out):
#    paths that behave differently when CUDA is there (fingerprint, device timer, NVML).
# Each failure's report is appended to OUT_DIR/failures.txt as it happens, so a run cut
# short by a time limit still says why. Logs: OUT_DIR/{build,cuda_tests,suite}.log.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-$(mktemp -d -t trainprof-gpu-check.XXXXXX)}}
mkdir -p "$OUT" && echo "logs: $OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d -t trainprof-site.XXXXXX)
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl || exit 1
    export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD/tools:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OUT
rm -f src/trainprof/capture/_fastclock*.so
$PY setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1 || echo "C fast path not built (see $OUT/build.log)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
$PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'CUDA', torch.cuda.is_available())"
XDIST=""; CUDA_XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n ${SUITE_PROCESSES:-4}" && CUDA_XDIST="-n ${CUDA_PROCESSES:-0}"
t0=$SECONDS
timeout "${CUDA_TIMEOUT:-300}" $PY -m pytest -v $CUDA_XDIST -p no:cacheprovider -p failure_log tests/test_cuda.py > "$OUT/cuda_tests.log" 2>&1
echo "tests/test_cuda.py: exit $? in $((SECONDS - t0)) s"; grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/cuda_tests.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//; s/ *\[.*//' | sort
t0=$SECONDS
if [ "${SUITE_TIMEOUT:-420}" != 0 ]; then
    timeout "${SUITE_TIMEOUT:-420}" $PY -m pytest -q $XDIST -p no:cacheprovider -p failure_log --ignore=tests/test_cuda.py tests > "$OUT/suite.log" 2>&1
    echo "the rest of the suite: exit $? in $((SECONDS - t0)) s"; tail -3 "$OUT/suite.log"
fi
grep "^==== " "$OUT/failures.txt" 2>/dev/null | sort -u
