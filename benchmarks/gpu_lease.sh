#!/usr/bin/env bash
# A device lease's gpu_check runs (benchmarks/README.md, "On a GPU machine"), in two calls of
# the device tool on one warm machine: each run resumes the one before from the caches it left
# in /tmp (numba's, torch.compile's, Triton's), where compiling, not checking, is what a run
# spends its budget on.
#
#   bash benchmarks/gpu_lease.sh 1   # install the carried wheels; run a (correctness from an
#                                    # empty cache), then run b (speed, host cost, CUDA graph:
#                                    # its warm-ups compile every peer)
#   bash benchmarks/gpu_lease.sh 2   # run c (the correctness cases a left, the sanitizer and
#                                    # CPU scaling), then run d (speed again, its peers'
#                                    # compiles cached by b)
#
# Call 1 takes at most 455 s and call 2 at most 335 s, which with a machine's start (about a
# minute) fit a 15-minute lease, 20 s to spare at every run's time limit, only if call 2 is
# sent within the machine's 30 s idle time after call 1 returns (its files are in /tmp there;
# a fresh machine has neither them nor the caches, and call 2 then installs the wheels again).
# Give call 2 a timeout_s of at most the device's budget_left_s less 30 s: a call cut at its
# timeout_s returns what $OUT holds (run c's JSON among it), one cut by the lease's end returns nothing.
# Correctness and speed run apart because their warm-ups share phase 1: with every row norm's
# torch.compile peer compiling, one run's speed warm-ups took its whole phase 1 (2026-12-04).
# The sanitizer runs in c alone: from run a's empty caches its tools, compiling every kernel
# under instrumentation, reached 16-18 of its cases in 45 s, and it has no --resume. CPU
# scaling runs in c, every lease (the CPU kernels change between leases; its kernels compile
# in c's phase 1, and it times them after the sanitizer, the CPU otherwise idle). Writes
# $OUT/gpu-<kind>.json, -b, -c, -d and their logs; commit the JSONs under benchmarks/results/.
set -u -o pipefail
part=${1:?"part 1 or 2"}
OUT=${OUT:-/tmp/gpu-lease-out}
SITE=${SITE:-/tmp/site}  # the carried wheels, installed apart from the machine's own packages
mkdir -p "$OUT"
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -qi h200 && echo h200 || echo h100)
install() {  # the machine's versions, then the carried wheels (its NumPy 2.5.2 breaks numba-cuda 0.30)
    python3 -m pip list 2>/dev/null | grep -iE '^(numba|llvmlite|cuda-|ml.dtypes|cupy|torch |triton|numpy )'
    local W="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE"
    $W .whl/*.whl || exit 1
    # numbanorm's direct launch needs cuda-core >= 1.0: the carried one only where the machine's is older
    python3 -c 'import importlib.metadata as m,sys;sys.exit(int(m.version("cuda-core").split(".")[0])<1)' 2>/dev/null \
        || $W .whl/cuda/*.whl || exit 1
}
check() {  # one run: its name, a time limit (s), then gpu_check's arguments
    local name=$1 limit=$2
    shift 2
    timeout -k 10 "$limit" python3 -m benchmarks.gpu_check --out "$OUT/gpu-$kind$name.json" "$@" 2>&1 \
        | grep -v -e NumbaPerformanceWarning -e "warn(errors" | tee "$OUT/gpu-check-$kind$name.log" | tail -25
    cp "$OUT/gpu-$kind$name.json" "/tmp/gpu-$kind$name.json" 2>/dev/null  # $OUT is emptied before each call
}
case $part in
1)
    install
    check "" 270 --only correctness --deadline 255 --budget correctness=235
    check -b 165 --only speed host graph model --deadline 150 --budget correctness=100 speed=30 host=10 graph=10
    ;;
2)
    [ -d "$SITE" ] || install  # a fresh machine: call 2 came after the idle window
    # (a missing run a is nothing to resume: run c then checks from the start)
    check -c 195 --resume "/tmp/gpu-$kind.json" --only correctness sanitizer cpu_scaling --deadline 180 \
        --budget correctness=85 sanitizer=40 cpu_scaling=35
    check -d 140 --only speed host graph model --deadline 125 --budget correctness=75 speed=30 host=10 graph=10
    ;;
*)
    echo "part 1 or 2" >&2
    exit 2
    ;;
esac
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
