#!/usr/bin/env bash
# A device lease's gpu_check runs (benchmarks/README.md, "On a GPU machine"), in two calls of
# the device tool on one warm machine: each run resumes the one before from the caches it left
# in /tmp (numba's, torch.compile's, Triton's), where compiling, not checking, is what a run
# spends its budget on.
#
#   bash benchmarks/gpu_lease.sh 1   # install the carried wheels; run a (correctness and the
#                                    # sanitizer from an empty cache), then run b (speed, host
#                                    # cost, CUDA graph: its warm-ups compile every peer)
#   bash benchmarks/gpu_lease.sh 2   # run c (the correctness and sanitizer cases a left), then
#                                    # run d (speed again, its peers' compiles cached by b)
#
# Call 1 takes at most 500 s and call 2 at most 330 s, which with a machine's start (about a
# minute) fit a 15-minute lease only if call 2 is sent within the machine's 30 s idle time
# after call 1 returns (its files are in /tmp there; a fresh machine has neither them nor the
# caches). Correctness and speed run apart because their warm-ups share phase 1: with every
# row norm's torch.compile peer compiling, one run's speed warm-ups took its whole phase 1
# (2026-12-04). Writes $OUT/gpu-<kind>.json, -b, -c, -d and their logs; commit the JSONs
# under benchmarks/results/.
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
    # (CPU scaling left out: the CPU kernels have not changed since the lease that measured it)
    check "" 305 --deadline 290 --skip speed host graph cpu_scaling --budget correctness=240 sanitizer=45
    check -b 165 --only speed host graph model --deadline 150 --budget correctness=100 speed=30 host=10 graph=10
    ;;
2)
    check -c 190 --resume "/tmp/gpu-$kind.json" --deadline 175 --skip speed host graph cpu_scaling \
        --budget correctness=120 sanitizer=45
    check -d 140 --only speed host graph model --deadline 125 --budget correctness=75 speed=30 host=10 graph=10
    ;;
*)
    echo "part 1 or 2" >&2
    exit 2
    ;;
esac
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
