#!/usr/bin/env bash
# Run the GPU tests (pytest -m gpu) under compute-sanitizer's memcheck, racecheck and
# synccheck, where a CUDA GPU and the tool exist. compute-sanitizer comes from PATH, a
# CUDA toolkit ($CUDA_PATH, /usr/local/cuda) or the `nvidia-cuda-sanitizer-api` wheel.
# Works from a plain checkout (the repository goes on PYTHONPATH). Extra arguments go to
# pytest; the options below come first.
#
#   tools/sanitize_gpu.sh                      # every GPU test, three tools
#   tools/sanitize_gpu.sh -k stream            # a subset
#   tools/sanitize_gpu.sh --timeout 90 tests/test_kernels_backward.py
#   tools/sanitize_gpu.sh --budget 240         # the three tools within 240 s
#   tools/sanitize_gpu.sh --dry-run            # where the tool is, what would run; no GPU
#
#   --timeout S   stop each tool's run after S seconds (what ran so far is reported)
#   --budget S    the three tools share S seconds, in the order memcheck, synccheck,
#                 racecheck (the slowest last, with what the others leave); each stops at
#                 what is left less 20 s for every tool after it
#   --dry-run     print the tool found and the commands, run nothing
#
# Each tool ends with one line, for people and for tools/gpu_check.py:
#   sanitize_gpu: memcheck: exit=0 errors=0 tests=[12 passed, 1 skipped in 40.1s]
# errors= sums compute-sanitizer's "ERROR SUMMARY" lines ("?" when it printed none: it
# was stopped); tests= is pytest's closing line, or the outcomes counted so far.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-$(command -v python3 || command -v python)}

timeout_s=""
budget_s=""
dry_run=0
while [ $# -gt 0 ]; do
    case "$1" in
        --timeout)
            case "${2:-}" in
                ''|*[!0-9]*) echo "sanitize_gpu: --timeout takes whole seconds; got '${2:-}'" >&2; exit 2 ;;
            esac
            timeout_s=$2; shift 2 ;;
        --budget)
            case "${2:-}" in
                ''|*[!0-9]*) echo "sanitize_gpu: --budget takes whole seconds; got '${2:-}'" >&2; exit 2 ;;
            esac
            budget_s=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        *) break ;;
    esac
done

find_tool() {
    command -v compute-sanitizer && return
    local root
    for root in "${CUDA_PATH:-}" "${CUDA_HOME:-}" /usr/local/cuda; do
        [ -n "$root" ] || continue
        for exe in "$root/bin/compute-sanitizer" "$root/compute-sanitizer/compute-sanitizer"; do
            [ -x "$exe" ] && { echo "$exe"; return; }
        done
    done
    "$py" - <<'PY'
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
}
tool=$(find_tool)

# Every array its own cudaMalloc: memcheck sees an overrun only at an allocation's edge,
# and CuPy's pool packs many arrays into one allocation.
run_pytest='import sys, cupy, pytest; cupy.cuda.set_allocator(None); sys.exit(pytest.main(sys.argv[1:]))'
pytest_args=(-m gpu -v -p no:cacheprovider "$@")
checks=(memcheck synccheck racecheck)   # racecheck, the slowest, takes what is left

# The seconds tool number $1 (0-based) may run: --timeout, or under --budget what is left
# less 20 s for each tool after it (at least 10); empty for no limit.
tool_limit() {
    local limit=$timeout_s
    if [ -n "$budget_s" ]; then
        local left=$(( budget_s - SECONDS - 20 * (${#checks[@]} - 1 - $1) ))
        [ "$left" -lt 10 ] && left=10
        [ -z "$limit" ] || [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "$limit"
}

if [ "$dry_run" = 1 ]; then
    echo "sanitize_gpu --dry-run: compute-sanitizer: ${tool:-not found (PATH, CUDA_PATH, /usr/local/cuda, or pip install nvidia-cuda-sanitizer-api)}"
    for check in "${checks[@]}"; do
        echo "  would run: compute-sanitizer --tool $check --error-exitcode 99 $py -c <pytest without CuPy's pool> ${pytest_args[*]}${timeout_s:+ (stopped after ${timeout_s} s)}"
    done
    [ -n "$budget_s" ] && echo "  the three within ${budget_s} s, racecheck last"
    exit 0
fi
if ! "$py" -c "import cupy, sys; sys.exit(cupy.cuda.runtime.getDeviceCount() == 0)" 2>/dev/null; then
    echo "sanitize_gpu: no CUDA GPU visible to CuPy; nothing to check."
    exit 0
fi
if [ -z "$tool" ]; then
    echo "sanitize_gpu: compute-sanitizer not found (PATH, CUDA_PATH, /usr/local/cuda, or pip install nvidia-cuda-sanitizer-api)."
    exit 0
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
SECONDS=0
for i in "${!checks[@]}"; do
    check=${checks[$i]}
    echo "== compute-sanitizer --tool $check: pytest ${pytest_args[*]}"
    limit=()
    seconds=$(tool_limit "$i")
    [ -n "$seconds" ] && limit=(timeout -k 10 "$seconds")
    # --error-exitcode makes a finding fail the run even when pytest itself passed
    ${limit[@]+"${limit[@]}"} "$tool" --tool "$check" --error-exitcode 99 --target-processes all \
        "$py" -c "$run_pytest" "${pytest_args[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || status=1
    errors=$(grep -oE "ERROR SUMMARY: [0-9]+" "$log" | awk '{n += $3} END {print NR ? n : "?"}')
    tests=$(grep -E "^=* ?(no tests ran|[0-9]+ [a-z]+.*) in [0-9.]+s" "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    if [ -z "$tests" ]; then
        tests=$(grep -oE "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)" "$log" | sort | uniq -c |
                awk '{printf "%s%d %s", (NR > 1 ? ", " : ""), $1, tolower($2)} END {if (!NR) printf "none"}')
        tests="$tests so far, stopped"
    fi
    # a run stopped mid-line leaves no newline: the result line starts a line of its own
    [ -n "$(tail -c 1 "$log")" ] && echo
    echo "sanitize_gpu: $check: exit=$rc errors=$errors tests=[$tests]"
done
exit $status
