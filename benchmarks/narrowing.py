"""bfloat16 rows at the vector width of another CPU: the narrowing loop's instructions and its speed.

    python -m benchmarks.narrowing                      # this CPU, and AVX2 (Zen 3) code run here
    python -m benchmarks.narrowing --targets host       # one of them
    python -m benchmarks.narrowing --json benchmarks/results/narrowing-xeon.json
    python -m benchmarks.narrowing --baseline ../before  # a worktree of the commit before a change

Each target runs in a process of its own, compiled for the CPU that ``NUMBA_CPU_NAME`` and
``NUMBA_CPU_FEATURES`` name (``znver3``: AMD Zen 3's features, AVX2 and F16C without
AVX-512, which an AVX-512 CPU executes as well), with a kernel cache of its own.  In it:

- the streamed row loop of the LayerNorm and RMSNorm forward (bfloat16 x, float32 weight
  and bias), read from the machine code: its vector instructions per 16 elements, and
  those of the narrowing alone (from the float32 result to the stored bits);
- the forward into a preallocated ``out=`` of (16384, 4096) bfloat16, round-robin
  against ``np.copyto`` and the same copy on every numba thread: the median over rounds
  of each round's ratio to the faster copy (the targets' "floors").

The processes alternate, ``--rounds`` times each, so a slow moment of a shared machine
falls on both targets alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# AMD Zen 3 as LLVM defines it (X86.td: ZN3 features), everything else off
ZNVER3 = ("64bit,adx,aes,avx,avx2,bmi,bmi2,clflushopt,clwb,clzero,cmov,crc32,cx16,cx8,f16c,fma,fsgsbase,"
          "fxsr,invpcid,lzcnt,mmx,movbe,mwaitx,pclmul,pku,popcnt,prfchw,rdpid,rdrnd,rdseed,sahf,sha,sse,"
          "sse2,sse3,sse4.1,sse4.2,sse4a,ssse3,vaes,vpclmulqdq,wbnoinvd,xsave,xsavec,xsaveopt,xsaves")


def cpu_env(name):
    """The environment that makes Numba compile for ``name`` (``host``: this CPU)."""
    if name == "host":
        return {}
    if name != "znver3":
        raise ValueError(f"unknown target {name!r}: host or znver3")
    import llvmlite.binding as ll

    on = set(ZNVER3.split(","))
    host = [f[1:] for f in ll.get_host_cpu_features().flatten().split(",")]
    return {"NUMBA_CPU_NAME": "znver3",
            "NUMBA_CPU_FEATURES": ",".join(("+" if f in on else "-") + f for f in sorted(set(host) | on))}


VECTOR = re.compile(r"%[xyz]mm\d+")
# from the float32 result to the stored bits: the rounding, the NaN select, the packing (or
# the instruction and its subnormal test)
NARROWING = re.compile(r"^(vpsrld|vpaddd|vpandn?[dq]?|vpor[dq]?|vpternlogd|vcmpunordps|vblendvps|vpblendm[dw]|"
                       r"vpblendvb|vextract[fi](128|32x4|64x4)|vpackusdw|vpermq|vpmovdw|vpcmpeqd|vpsubd|"
                       r"vcvtneps2bf16|vfpclassps)$")


def _loops(lines, where):
    """The innermost loops around the instructions ``where`` picks: lists of instructions."""
    loops = []
    for at in (k for k, ln in enumerate(lines) if where(ln)):
        top = at
        while not re.match(r"^\.?LBB\S*:$", lines[top]):
            top -= 1
        label = lines[top][:-1]
        end = next((k for k in range(at, len(lines)) if re.match(rf"^j\w+\s+{re.escape(label)}$", lines[k])),
                   None)
        if end is not None:
            loops.append([ln for ln in lines[top + 1:end + 1] if ln and not ln.startswith((".", "#"))])
    return loops


def streamed_loop(asm):
    """The instructions of the innermost loop that stores 16-bit bits with streaming stores
    (``vmovntdq``, put_streaming's; memory.stream_row copies a staged row with ``vmovntps``).
    Where bfloat16 is narrowed by its instruction, the row writer's loop stores float32 to a
    chunk on the stack and put_bfloat16's loop narrows and streams it (halves): both then,
    the writer's first."""
    lines = [ln.strip() for ln in asm.splitlines()]
    loop = max(_loops(lines, lambda ln: ln.startswith("vmovntdq")), key=len)  # the longest, should LLVM split it
    if not any(ln.startswith("vcvtneps2bf16") for ln in loop):
        return loop
    # the writer: the loop that stores vectors at the stack offset the narrowing loop loads from
    offset = next(m.group(1) for ln in loop for m in [re.match(r"^vmov\w+\s+(-?\d*)\(%rsp,", ln)] if m)
    writers = _loops(lines, lambda ln: re.match(rf"^vmov\w+\s+%zmm\d+, {offset}\(%rsp,", ln) is not None)
    return max(writers, key=len) + loop


def _stored(loop):
    """Elements a loop stores an iteration: 16-bit streamed, else float32 to the stack."""
    bits = sum({"x": 16, "y": 32, "z": 64}[m.group(1)] // 2
               for ln in loop for m in [re.match(r"^vmovnt\w+\s+%([xyz])mm", ln)] if m)
    return bits or sum({"x": 4, "y": 8, "z": 16}[m.group(1)]
                       for ln in loop for m in [re.match(r"^vmov\w+\s+%([xyz])mm\d+, \S*\(%rsp", ln)] if m)


def count(loop):
    """``{elements, vector, narrowing}`` per 16 elements of a streamed loop of bfloat16 stores
    (of streamed_loop's two, each per the elements it stores)."""
    ends = [k + 1 for k, ln in enumerate(loop) if re.match(r"^j\w+\s", ln)]
    parts = [loop[a:b] for a, b in zip([0] + ends[:-1], ends)] if len(ends) == 2 else [loop]
    vector = narrowing = 0.0
    for part in parts:
        vec = [ln.split()[0] for ln in part if VECTOR.search(ln)]
        vector += len(vec) * 16 / _stored(part)
        narrowing += sum(1 for op in vec if NARROWING.match(op)) * 16 / _stored(part)
    return {"elements_per_iteration": _stored(parts[-1]), "vector_per_16": round(vector, 1),
            "narrowing_per_16": round(narrowing, 1), "loop": loop}


def _rows_asm(mod):
    """The machine code of ``mod.forward_rows``'s streaming variant for the bfloat16 call
    above: the row function's types, compiled afresh here (a function loaded from the cache,
    or compiled already, keeps no machine code to read)."""
    from numba import njit, types

    from numbanorm.cpu._kernels.common import with_flags

    # the row function's types, from whichever of the plain and streaming variants' row
    # functions and parallel kernels (block first) this process compiled or loaded
    bf16 = types.Array(types.int16, 2, "C")
    kernels = (mod._forward, mod._forward.streaming())
    sig = next(iter([tuple(s) for k in kernels for s in k.signatures if s[0] == bf16]
                    + [tuple(s[1:]) + (types.int64, types.int64)
                       for k in kernels for s in k.parallel.signatures if s[1] == bf16]))
    fn = mod.forward_rows
    options = {k: v for k, v in fn.targetoptions.items() if k not in ("nopython", "boundscheck", "cache")}
    rows = njit(**options)(with_flags(fn, STREAMING=True))  # (the streamed stores: this variant's alone)
    rows.compile(sig)
    return rows.inspect_asm(sig)


def _child(rounds, shape, budget_s=0.2):
    """This process's target: the loops and the ratios (run with cpu_env's environment)."""
    import ml_dtypes
    import numba

    import numbanorm
    from numbanorm.cpu._kernels import halves, layer_norm, memory, rms_norm

    from .measure import parallel_copy

    memory.STREAM_MIN_BYTES = 0  # every output streamed, the small one that compiles them too
    out = {"cpu": halves._cpu_name(), "wide_16bit_rows": bool(halves.WIDE_HALVES),
           "threads": numba.get_num_threads(), "norms": {}}
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    w = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    b = rng.standard_normal(shape[1]).astype(np.float32)
    y, dst = np.empty_like(x), np.empty_like(x)
    calls = {"layer_norm": lambda: numbanorm.layer_norm(x, shape[1:], w, b, out=y),
             "rms_norm": lambda: numbanorm.rms_norm(x, shape[1:], w, out=y)}
    for name, mod in (("layer_norm", layer_norm), ("rms_norm", rms_norm)):
        calls[name]()
        out["norms"][name] = count(streamed_loop(_rows_asm(mod)))
    from .design_probes import timed_rounds

    t = timed_rounds({"copy": lambda: np.copyto(dst, x), "copy_threads": lambda: parallel_copy(dst, x),
                      **calls}, rounds)
    for name in calls:
        over = np.maximum(t[name] / t["copy"], t[name] / t["copy_threads"])
        out["norms"][name]["x_floors"] = round(float(np.median(over)), 3)
    out["copy_threads_over_copy"] = round(float(np.median(t["copy_threads"] / t["copy"])), 3)
    return out


def run(targets, processes, rounds, shape, baseline=None):
    """``{target: [child results]}``: ``processes`` alternated child processes per target;
    with ``baseline`` (another checkout's root) each target's processes alternate with ones
    running that checkout's ``numbanorm`` (this probe's code), as ``<target>@baseline``."""
    from .harness import child_env, link_checkout

    got = {}
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="numbanorm-narrowing-") as tmp:
        sides = {"": root}
        if baseline is not None:
            sides["@baseline"] = link_checkout(baseline, tmp)
        for _ in range(processes):
            for t in targets:
                for side, first in sides.items():
                    env = child_env(first, os.path.join(tmp, "cache" + t + side), **cpu_env(t))
                    cmd = [sys.executable, "-m", "benchmarks.narrowing", "--child", "--rounds", str(rounds),
                           "--shape", *map(str, shape)]
                    p = subprocess.run(cmd, env=env, cwd=first, capture_output=True, text=True)
                    if p.returncode:
                        raise RuntimeError(f"{t}{side}: {' '.join(cmd)} failed:\n{p.stderr}")
                    got.setdefault(t + side, []).append(json.loads(p.stdout))
    return got


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.narrowing", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--targets", default="host,znver3", help="comma-separated, of host,znver3")
    ap.add_argument("--processes", type=int, default=3, help="alternated processes per target (3)")
    ap.add_argument("--rounds", type=int, default=15, help="round-robin rounds in each (15)")
    ap.add_argument("--shape", type=int, nargs=2, default=(16384, 4096))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--baseline", help="another checkout (a git worktree) whose numbanorm runs alternated with "
                                       "this one's, for a change's before and after")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.rounds, tuple(a.shape))))
        return 0
    from .harness import git_state, metadata

    load_before, t0 = list(os.getloadavg()), time.perf_counter()
    got = run(a.targets.split(","), a.processes, a.rounds, tuple(a.shape), a.baseline)
    for t, runs in got.items():
        for name in ("layer_norm", "rms_norm"):
            c = runs[0]["norms"][name]
            ratios = ", ".join(f"{r['norms'][name]['x_floors']:.2f}x" for r in runs)
            print(f"{t:<16} ({runs[0]['cpu']}) {name:<10} {c['elements_per_iteration']} elements an iteration, "
                  f"{c['vector_per_16']} vector instructions per 16 ({c['narrowing_per_16']} narrowing); "
                  f"out= over the faster copy: {ratios}")
    if a.json:
        import numba

        res = {"shape": list(a.shape), "targets": got, "baseline": a.baseline and git_state(a.baseline)["commit"],
               "meta": metadata(numba.config.NUMBA_NUM_THREADS, load_before=load_before,
                                load_after=list(os.getloadavg()),
                                timing={"wall_s": round(time.perf_counter() - t0, 1), "rounds": a.rounds,
                                        "processes": a.processes})}
        res["meta"]["command"] = " ".join(["python", "-m", "benchmarks.narrowing", *sys.argv[1:]])
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
