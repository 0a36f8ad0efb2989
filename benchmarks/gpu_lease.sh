#!/usr/bin/env bash
# A device lease's gpu_check runs (benchmarks/README.md, "On a GPU machine"), in two calls of
# the device tool on one warm machine: each run resumes the one before from the numba cache it
# left in /tmp, where compiling, not checking, is what a run spends its budget on.
#
#   bash benchmarks/gpu_lease.sh 1   # install the carried wheels; run a (every section, from an
#                                    # empty cache), then run b (speed at every N, host, graph)
#   bash benchmarks/gpu_lease.sh 2   # run c (the correctness cases left, sanitizer, host, graph),
#                                    # then the launch knobs (--only tune)
#
# Call 1 takes at most 500 s and call 2 at most 330 s, which with a machine's start (about a
# minute) fit a 15-minute lease only if call 2 is sent within the machine's 30 s idle time
# after call 1 returns (its files are in /tmp there; a fresh machine has neither them nor the
# cache); the second lease's runs, with budgets of this kind, took 419 s and 122 + 161 s.
# Writes $OUT/gpu-<kind>.json, -b, -c, -tune and their logs; commit the JSONs under
# benchmarks/results/.
set -u -o pipefail
part=${1:?"part 1 or 2"}
OUT=${OUT:-/tmp/gpu-lease-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -qi h200 && echo h200 || echo h100)
check() {  # one run: its name, a time limit (s), then gpu_check's arguments
    local name=$1 limit=$2
    shift 2
    timeout -k 10 "$limit" python3 -m benchmarks.gpu_check --out "$OUT/gpu-$kind$name.json" "$@" 2>&1 \
        | grep -v -e NumbaPerformanceWarning -e "warn(errors" | tee "$OUT/gpu-check-$kind$name.log" | tail -25
    cp "$OUT/gpu-$kind$name.json" "/tmp/gpu-$kind$name.json" 2>/dev/null  # $OUT is emptied before each call
}
case $part in
1)
    python3 -m pip list 2>/dev/null | grep -iE '^(numba|llvmlite|cuda-|ml.dtypes|cupy|torch |triton|numpy )'
    W="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site"
    $W .whl/*.whl || exit 1
    # numbanorm's direct launch needs cuda-core >= 1.0: the carried one only where the machine's is older
    python3 -c 'import importlib.metadata as m,sys;sys.exit(int(m.version("cuda-core").split(".")[0])<1)' 2>/dev/null \
        || $W .whl/cuda/*.whl || exit 1
    check "" 305 --deadline 290
    check -b 165 --resume "/tmp/gpu-$kind.json" --deadline 150 --skip sanitizer cpu_scaling \
        --budget correctness=90 speed=40
    ;;
2)
    check -c 190 --resume "/tmp/gpu-$kind-b.json" --deadline 175 --skip speed cpu_scaling \
        --budget correctness=120 sanitizer=45
    check -tune 140 --only tune --deadline 125 --budget tune=115
    ;;
*)
    echo "part 1 or 2" >&2
    exit 2
    ;;
esac
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
