#!/usr/bin/env bash
# Run the GPU tests (pytest -m gpu) under compute-sanitizer's memcheck, racecheck and
# synccheck, where a CUDA GPU and the tool exist. compute-sanitizer comes from a CUDA
# toolkit on PATH or from the `nvidia-cuda-sanitizer-api-cu12` wheel
# (pip install nvidia-cuda-sanitizer-api-cu12). Extra arguments go to pytest.
#
#   tools/sanitize_gpu.sh            # every GPU test, three tools
#   tools/sanitize_gpu.sh -k stream  # a subset
set -uo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import cupy, sys; sys.exit(cupy.cuda.runtime.getDeviceCount() == 0)" 2>/dev/null; then
    echo "sanitize_gpu: no CUDA GPU visible to CuPy; nothing to check."
    exit 0
fi
tool=$(command -v compute-sanitizer || true)
if [ -z "$tool" ]; then
    tool=$(python - <<'PY'
import pathlib
try:
    import nvidia
except ImportError:
    raise SystemExit
for base in map(pathlib.Path, nvidia.__path__):
    for exe in sorted(base.glob("*/compute-sanitizer/compute-sanitizer")):
        print(exe)
        raise SystemExit
PY
)
fi
if [ -z "$tool" ]; then
    echo "sanitize_gpu: compute-sanitizer not found (PATH, or pip install nvidia-cuda-sanitizer-api-cu12)."
    exit 0
fi

status=0
for check in memcheck racecheck synccheck; do
    echo "== compute-sanitizer --tool $check: pytest -m gpu $*"
    # --error-exitcode makes a finding fail the run even when pytest itself passed
    "$tool" --tool "$check" --error-exitcode 99 --target-processes all \
        python -m pytest -m gpu -q -p no:cacheprovider "$@" || status=1
done
exit $status
