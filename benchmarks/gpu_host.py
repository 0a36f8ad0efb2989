"""Host cost of one public GPU call, without a GPU: ``tests/_nosim_launch.py host`` runs
numba-cuda's real launch path with only the driver stubbed (allocations are numba
arrays over fake addresses, the launch records its arguments) and reports, per call
(LayerNorm, RMSNorm, GroupNorm, fused add + LayerNorm; forward and backward; float16):

* ``full``: the frontend's full path (validation, allocation, launchers, the cached
  direct launch) -- every call before the replays;
* ``numba``: the full path launching through numba-cuda's ``_Kernel.launch``;
* ``replay``: the frontend's methods, a call seen before replayed (``cuda._backend.Replays``);
  ``layer_norm_cuda``/``layer_norm_top``: the same LayerNorm forward by
  ``numbanorm.cuda.layer_norm`` and by ``numbanorm.layer_norm`` (which picks the GPU first);
  ``layer_norm_foreign``: on another library's arrays (a CuPy-like ``__cuda_array_interface__``);
* ``<call>_torch``, ``<call>_cupy``: the same calls on CUDA torch tensors and CuPy arrays
  (the stand-ins of ``tests/_fake_libs.py``: this machine's torch has no CUDA), replayed
  (the public functions) and by the full path (``_full``); ``layer_norm_top_torch``,
  ``layer_norm_top_cupy``: ``numbanorm.layer_norm`` on them (replayed);
* the harness's own share: ``stub_driver`` (one stubbed launch, with a LayerNorm forward's
  arguments: the stub's cost grows with the argument count, so for other kernels it is
  an estimate), ``stub_alloc`` (one stubbed allocation) of which ``numba_array``
  (numba's array object) is numba's, the rest the stub's; ``torch_alloc``/``cupy_alloc``
  (one allocation of the stand-ins) and ``torch_stream``/``cupy_stream`` (one current-
  stream query); a real driver replaces the stub's share with its own (cuLaunchKernel,
  and numba's allocator's cuMemAlloc), real PyTorch and CuPy the stand-ins' with theirs.
  ``<call>_stub`` is that share of a call.

The figures are host (CPU) time with the driver stubbed, not device measurements.

Two measurements of the same code, garbage collection off (as in timeit): this
thread's CPU time (best of 7 rounds; on a shared machine the wall time is mostly
waiting for a CPU) and, where valgrind is installed, callgrind's instruction count
of each path (the figures to compare across runs and machines).

    python -m benchmarks.gpu_host --json benchmarks/results/gpu-host.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(os.path.dirname(HERE), "tests", "_nosim_launch.py")


# the plain LayerNorm by numbanorm.cuda.layer_norm and by numbanorm.layer_norm (numba, torch
# and CuPy arrays), and its forward on another library's arrays (``__cuda_array_interface__``,
# full path and replayed)
EXTRA = ("layer_norm_cuda", "layer_norm_top", "layer_norm_top_torch", "layer_norm_top_cupy", "layer_norm_foreign")
LIBRARIES = ("torch", "cupy")  # the stand-ins' calls: <call>_<library> (replayed) and <call>_<library>_full


def _harness(args, env, prefix=()):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", **env)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    out = subprocess.run([*prefix, sys.executable, HARNESS, "host", *map(str, args)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def instructions(M, N, calls, env):
    """Instructions per call of each path, counted by callgrind in its own region."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        res = _harness((M, N, calls), dict(env, NN_CALLGRIND="1"),
                       ("valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=math_fsum",
                        "--dump-after=math_fsum", f"--callgrind-out-file={out}"))
        dumps = sorted(glob.glob(out + ".*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        counts = []
        for path in dumps:
            with open(path) as f:
                total = next(int(line.split()[1]) for line in f if line.startswith(("summary:", "totals:")))
            counts.append(total)
    if len(counts) != len(res["order"]):
        raise RuntimeError(f"{len(counts)} callgrind dumps for {len(res['order'])} paths")
    return {name: round(n / calls) for name, n in zip(res["order"], counts)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed round")
    ap.add_argument("--callgrind-calls", type=int, default=50)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    env = {"NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "nn-gpu-host"))}
    cpu = _harness((a.rows, a.hidden, a.calls), env)
    res = {"shape": [a.rows, a.hidden], "dtype": "float16",
           "what": "host (CPU) time per call with the CUDA driver stubbed, on the machine of meta "
                   "(its load average: loadavg; best of 7 rounds, this thread's CPU time); torch and CuPy "
                   "are stand-ins (tests/_fake_libs.py); not a device measurement",
           "cpu_us": {}, "instructions": {},
           "launches": {k[:-9]: v for k, v in cpu.items() if k.endswith("_launches")},
           "allocations": {k[:-7]: v for k, v in cpu.items() if k.endswith("_allocs")},
           "loadavg": cpu["loadavg"]}
    res["cpu_us"] = {k[:-7]: v for k, v in cpu.items() if k.endswith("_cpu_us")}
    if shutil.which("valgrind"):
        res["instructions"] = instructions(a.rows, a.hidden, a.callgrind_calls, env)
    # what of each path is the harness's: its allocations' and launches' stubs, less the
    # numba array object each allocation makes (numba's, on a GPU too)
    for unit in ("cpu_us", "instructions"):
        t = res[unit]
        if not t:
            continue
        alloc = {None: t["stub_alloc"] - t["numba_array"], "torch": t["torch_alloc"], "cupy": t["cupy_alloc"]}
        stream = {None: 0, "torch": t["torch_stream"], "cupy": t["cupy_stream"]}
        for call, n in res["launches"].items():
            lib = call.rsplit("_", 1)[1] if call.endswith(LIBRARIES) else None
            stub = n * t["stub_driver"] + res["allocations"][call] * alloc[lib] + stream[lib]
            t[call + "_stub"] = round(stub, 2)
        t["layer_norm_foreign_stub"] = t["layer_norm_forward_stub"]  # (the same forward: launch and allocations)
    for unit in ("cpu_us", "instructions"):
        t = res[unit]
        for call in res["launches"]:
            if call in EXTRA:
                continue
            if t and call.endswith(LIBRARIES):
                print(f"{unit:12} {call:31} full {t[call + '_full']:>10} {'':16} "
                      f"replay {t[call]:>10}  (stub {t[call + '_stub']})")
            elif t:
                print(f"{unit:12} {call:31} full {t[call + '_full']:>10} numba {t[call + '_numba']:>10} "
                      f"replay {t[call + '_replay']:>10}  (stub {t[call + '_stub']})")
        for name in EXTRA:
            if t:
                full = f"full {t[name + '_full']:>10}" if name + "_full" in t else ""
                replay = t[name + "_replay"] if name + "_replay" in t else t[name]
                print(f"{unit:12} {name:31} {full:39} replay {replay:>10}  (stub {t[name + '_stub']})")
    if a.json:
        from .harness import metadata

        res["meta"] = metadata(None, load_before=[float(v) for v in cpu["loadavg"]], load_after=list(os.getloadavg()))
        res["meta"]["command"] = " ".join(["python", "-m", "benchmarks.gpu_host", *(argv or sys.argv[1:])])
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
