"""A static model of the GPU kernels on an H100, compiled from their own SASS.

    python -m benchmarks.gpu_model --json FILE --sass-dir DIR [--quick] [--gate]

No GPU is needed: every kernel that numbanorm's public GPU functions launch at
M = 32768 rows of N in {1024, ..., 32768} elements (float16, bfloat16, float32)
is compiled for sm_90 with NVVM (``numbanorm.cuda._ptx``), assembled by ptxas,
disassembled by nvdisasm, and the SASS is read.  **Every figure this tool
derives is a model, not a measurement**: nothing here ran on a GPU.

Which kernels
-------------
The public functions themselves are driven (``numbanorm._api.Frontend`` over
the CUDA backend) with stand-in device arrays (NumPy memory that is never
touched, flagged as device arrays), and ``common.launch`` is replaced by a
recorder: the grid, block, kernel and argument types of each record are the
ones the real launch configuration code picks.  ``kernel`` is the public name,
``launch`` the kernel within it: ``main`` for the launch that moves the most
bytes (the one streaming the rows and writing the result), else the kernel
function's name (``column_sums``, ``cast``, ``channel_sums``).  GroupNorm runs
on x of shape (M / 32, 128, N / 4) with 32 groups: M rows (sample, group) of N
elements; its backward kernels work per channel (``launch_rows``, ``row_words``).
A full run also models GroupNorm at the diffusion UNets' shapes the device check times
(``GN_SHAPES``, 32 groups), in records of their own (``group_shapes_records``, with their
``shape``), for ``gpu_check.model_rows`` to set beside its speed rows.

Exit status: 0; 1 when a kernel spills more than ``numbanorm.cuda._ptx``'s
budget (CI), or with ``--gate`` fails the gate (``gate_failures``: no spill at all;
the LayerNorm/RMSNorm row kernels and their fused forms, and GroupNorm's launches
that stream rows, at N <= 8192 at issue_memory_ratio <= 0.6, the 16-bit ones loading
128 bits, and at 1024 <= N <= 8192 with IN_FLIGHT_MIN (40 KB) of their row arrays in
flight per SM); 3 when NVVM, ptxas or nvdisasm is missing (``pip install
numbanorm[test]``) or the simulator is on.

How the SASS is read (``loop_instructions``)
--------------------------------------------
The SASS is split into basic blocks at labels and after branches, exits and
returns.  A branch to an earlier address closes a loop.  The *row loop* is the
outermost loop holding a global load or store: the persistent-grid loop over
rows.  One iteration of it is one row for the warp's row group, and
``loop_instructions`` is what one warp issues in it:

* every instruction of the row loop counts once per iteration, predicated or
  not (a predicated-off instruction is still issued), except blocks that call a
  ptxas subroutine (``CALL`` to a ``$__internal`` slow path: a division or square
  root's rare operands, 64-bit division by a 64-bit value) -- the inline fast
  path beside them is counted instead;
* an inner loop counts (its instructions) x (iterations), where the trip count
  is the one the mapping implies and the unroll factor is read from the SASS:
  a loop over the thread's words of the row (it holds a global access) makes
  ceil(row words / threads per row) source iterations, and its unroll factor is
  the sum of its immediate increments of the word index (multiples of the
  threads per row); a loop over the warp partials of a block reduction (shared
  loads only) makes threads per row / 32 - 1 source iterations, and its unroll
  factor is its shared loads / their distinct offsets (one per value reduced);
* a loop inside a vote's rare branch is not the row loop (a pass after the rows over
  those a vote found out of range, ``stats.rescue_fns``), and is left out like the
  fallback;
* the out-of-line code of a collective ptxas cannot prove converged (what ``BRA.DIV``
  jumps to, after the kernel's body, and which jumps back into it) is no loop and is
  not counted: the warp reaches those collectives converged, after a vote;
* nested word loops (GroupNorm's long rows: its channels, then their words):
  the inner one takes the trips, the outer counts once;
* peeled remainder copies outside an unrolled loop and conditional blocks both
  count in full, so the count is an upper bound for a full, live row (slightly
  high for warps that skip the ``t == 0`` stores) -- except LayerNorm's two-pass
  fallback: the block a predicated branch skips right after a vote (``BAR.RED.OR``,
  ``VOTE.ANY``) runs only when a row of the block (or warp) has its shift, the
  mean of its first word, over a std from its mean (0.5% of Gaussian 16-bit rows,
  5% of float32 ones), and is counted apart, per row group that takes it
  (``fallback_instructions``; its loads are left out of ``load_bytes_per_row``).

Kernels without a row loop (``cast``) count their straight-line code once per
warp; ``column_sums`` counts its loop over the partial rows (``P / slices``
iterations) the same way; for these two ``loop_instructions`` is per warp, not
per row.  Launch totals add one pass of the code outside the row loop per warp
of the grid; ``warp_instructions_per_row`` is a launch's total over M.  ``global_load_bits`` is the widest global load
in the row loop (``LDG.E.64`` -> 64, ``LDG.E.128`` -> 128, ``LDG.E`` -> 32).

The model
---------
H100 SXM: 132 SMs at 1.98 GHz, 3.0 TB/s achievable copy bandwidth, i.e.
3.0e12 / (132 * 1.98e9) = 11.48 bytes per clock per SM, and 4 warp
instructions issued per clock per SM.  Per row:

    issue clocks  = warp instructions per row / 4
    memory clocks = DRAM bytes per row / 11.48
    issue_memory_ratio = issue clocks / memory clocks

Below ~0.6 a kernel can keep the memory system busy; above, issue is the
limit.  ``bytes_per_row`` is compulsory DRAM traffic: each array a launch
touches crosses DRAM once (re-reads of a row by the long-row loop path and
read-modify-writes of partial sums are assumed to hit L2; ``load_bytes_per_row``
is what the SASS requests from global memory, re-reads included: a long row
staged in shared memory, ``row_staged``, is requested once, and its later
passes' shared loads count as instructions, in loops over the row's words).  A row
kernel whose row group loads several rows at once (``rows_in_flight``: an iteration of
its row loop is that many rows) has its counts divided by them: per row.  A loop with
global accesses inside a row held in registers (which has no loop over its words) is
counted at one trip: GroupNorm's dx sums its group's channels there, one trip where
CHANNELS / GROUPS (4) <= the threads per row.

Bytes in flight (Little's law)
------------------------------
``occupancy_threads_per_sm`` is what registers (allocated per warp in units of 256),
static and dynamic shared memory (228 KB per SM, 1 KB reserved per block), 2048
threads and 32 blocks allow; ``resident_threads_per_sm`` is that or, less, what the
persistent grid puts on an SM (one wave of the blocks the launch bounds guarantee).
``sass_bytes_in_flight_per_thread`` is read from the SASS (``Sass.loads_in_flight``):
the most bytes of global loads a thread has issued and not yet waited for, a load
being waited for where an instruction first reads (or overwrites) one of its
registers -- branches, labels and barriers wait for nothing -- over two passes of the
row loop (a load left in flight for the next iteration counts).  It counts every load,
the broadcast ones too (LayerNorm's shift, the mean of the row's first word; the
backward's saved mean and rstd), which are one sector per warp in DRAM terms.  A row
kernel says what its own row arrays' loads are (``row_bytes_in_flight_per_thread``:
rows in flight x its arrays x elements per thread x bytes); ``row_bytes_in_flight_per_sm``
= resident threads x the smaller of the two (the SASS can only fall short of it, where
ptxas issues a row's loads after the first wait).  The estimate of the fraction of DRAM
bandwidth is Little's law: ``hbm_fraction_estimate`` = min(1, row bytes in flight per SM
x 132 / (3.0e12 B/s x LATENCY_S)), LATENCY_S the latency a load sees under a
bandwidth-saturating load: an assumption (1.8 us: unloaded HBM latency on Hopper is
about 0.5-0.8 us by pointer-chasing microbenchmarks, and queueing raises it under
load; 1.8 us is where 40 KB per SM, IN_FLIGHT_MIN, meets the 3.0 TB/s), not a
measurement.  ``bytes_in_flight_per_sm`` = resident threads x the SASS count.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import namedtuple

import numpy as np

from numbanorm.operations import BY_NAME, OPERATIONS

# ---------------------------------------------------------------- the model (assumptions)

SMS = 132
CLOCK_HZ = 1.98e9
DRAM_BYTES_PER_S = 3.0e12
ISSUE_PER_CLOCK = 4          # warp instructions per clock per SM
BYTES_PER_CLOCK = DRAM_BYTES_PER_S / (SMS * CLOCK_HZ)   # per SM: 11.48
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256          # registers are allocated per warp in units of 256
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
ISSUE_LIMIT = 0.6            # above: issue-bound (the issue's gate)
# Little's law: an SM streams DRAM at (bytes in flight) / latency.  LATENCY_S is the
# latency a load sees under a bandwidth-saturating load -- an assumption, not a
# measurement: unloaded HBM latency on Hopper is quoted at about 0.5-0.8 us by
# pointer-chasing microbenchmarks, and queueing raises it under load.  1.8 us is the
# latency at which the gate's 40 KB per SM reach DRAM_BYTES_PER_S:
# 40960 * 132 / 3.0e12 = 1.80e-6 s.
LATENCY_S = 1.8e-6
IN_FLIGHT_MIN = 40 * 1024    # bytes per SM a gated kernel keeps in flight at least (the gate)
CC = (9, 0)

MODEL = {
    "note": "every derived figure in this file is a MODEL computed from the SASS, not a measurement",
    "gpu": "H100 SXM (sm_90)",
    "sms": SMS,
    "clock_hz": CLOCK_HZ,
    "dram_bytes_per_s": DRAM_BYTES_PER_S,
    "dram_bytes_per_clock_per_sm": round(BYTES_PER_CLOCK, 3),
    "warp_instructions_issued_per_clock_per_sm": ISSUE_PER_CLOCK,
    "issue_memory_ratio": "issue clocks per row / memory clocks per row; <= 0.6 can keep DRAM busy",
    "registers_per_sm": REGISTERS_PER_SM,
    "register_allocation_unit_per_warp": REGISTER_UNIT,
    "shared_memory_per_sm": SMEM_PER_SM,
    "shared_memory_reserved_per_block": SMEM_RESERVED_PER_BLOCK,
    "max_threads_per_sm": THREADS_PER_SM,
    "max_blocks_per_sm": BLOCKS_PER_SM,
    "bytes_per_row": "compulsory DRAM traffic: every array a launch touches, once",
    "loaded_latency_s": LATENCY_S,
    "hbm_fraction_estimate": "Little's law: min(1, row bytes in flight per SM * sms / (dram_bytes_per_s * "
                             "loaded_latency_s)); the latency is an assumption (see benchmarks/gpu_model.py)",
    "bytes_in_flight_per_sm": "resident threads per SM (registers, shared memory and the persistent grid) x "
                              "the most bytes of global loads a thread has issued and not yet waited for (SASS)",
    "row_bytes_in_flight_per_sm": "the same for the row arrays' loads alone: the kernel's own count of them, "
                                  "where the SASS issues all of them before its first wait",
}

def _op_of(kernel):
    """The table's operation of a public forward or backward name."""
    return BY_NAME[kernel.rsplit("_", 1)[0]]


M_ROWS = 32768
NS = (1024, 2048, 4096, 8192, 16384, 32768)
DTYPES = ("float16", "bfloat16", "float32")
GROUPS, CHANNELS = 32, 128          # GroupNorm: x (M / GROUPS, CHANNELS, N * GROUPS / CHANNELS)
# GroupNorm at the diffusion UNets' shapes (N, C, H, W) in GN_GROUPS groups, as the device
# check times them: records of their own (``group_shapes_records``), beside its speed rows
GN_SHAPES = ((8, 512, 64, 64), (16, 256, 128, 128))
GN_GROUPS = 32
# the table's forward and backward functions: the unfused norms', then the fused forwards and backwards
_FUSED = [op for op in OPERATIONS if op.fused]
KERNELS = (tuple(f for op in OPERATIONS if not op.fused for f in op.functions[1:])
           + tuple(op.functions[1] for op in _FUSED) + tuple(op.functions[2] for op in _FUSED))
# the row kernels the gate is about, and GroupNorm's (its launches that stream rows)
GATED = tuple(k for k in KERNELS if _op_of(k).layout == "rows")
GATED_GROUPS = tuple(k for k in KERNELS if _op_of(k).layout == "groups")
SWEEP_MS = range(1, 4097)
SWEEP_KERNELS = ("layer_norm_forward", "layer_norm_backward")  # the forward, and a backward with its column sums
SWEEP_N, SWEEP_DTYPE = 1024, "float16"


def cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------- SASS

Instr = namedtuple("Instr", "addr pred op args")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:(@!?U?P[T0-9]+)\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_LABEL = re.compile(r"^([.$\w]+):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")


def parse_sass(text):
    """``(instructions, labels)`` of one function's SASS as nvdisasm prints it.

    ``labels`` maps a label to the index of the instruction it precedes.
    """
    ins, labels = [], {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            ins.append(Instr(int(m.group(1), 16), m.group(2) or "", m.group(3), m.group(4).strip()))
            continue
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(ins)
    return ins, labels


def _target(i):
    m = _TARGET.search(i.args)
    return m.group(1) if m else None


def global_bits(op):
    """Bits moved per thread by a global load/store opcode (``LDG.E.64`` -> 64)."""
    for mod in op.split(".")[1:]:
        if mod in ("128", "64", "32"):
            return int(mod)
        if mod in ("U16", "S16"):
            return 16
        if mod in ("U8", "S8"):
            return 8
    return 32


def _is_global(op):
    return op.split(".")[0] in ("LDG", "STG", "RED", "ATOMG")


def _imm(arg):
    arg = arg.strip()
    try:
        return int(arg, 16) if arg.lower().startswith(("0x", "-0x")) else int(arg)
    except ValueError:
        return None


class Sass:
    """One kernel's SASS: blocks, loops and the counts the model needs."""

    def __init__(self, text):
        self.ins, labels = parse_sass(text)
        self.index_of = dict(labels)
        self.label_idx = set(labels.values())
        n = len(self.ins)
        # the out-of-line code of a collective (shuffle, vote) that ptxas cannot prove the
        # warp converged at: BRA.DIV jumps there when the warp is divergent (never, where
        # every branch around it is a vote's) and it jumps back into the body, to the
        # instruction after the collective, with a branch that closes no loop
        handler = [False] * n
        for i in self.ins:
            t = self.index_of.get(_target(i)) if i.op.startswith("BRA.DIV") else None
            j = t
            while j is not None and j < n and not (self.ins[j].op == "BRA" and not self.ins[j].pred):
                handler[j] = True
                j += 1
            if j is not None and j < n:
                handler[j] = True
        # loops: a branch back to an earlier (or the same) instruction
        self.loops = []
        for k, i in enumerate(self.ins):
            if i.op.startswith("BRA") and not handler[k]:
                t = self.index_of.get(_target(i))
                if t is not None and t <= k:
                    self.loops.append((t, k))
        # instructions on a slow path: the blocks holding a CALL to a subroutine
        starts = sorted({0, *labels.values(), *(k + 1 for k, i in enumerate(self.ins)
                                                if i.op.split(".")[0] in ("BRA", "EXIT", "RET"))})
        starts = [s for s in starts if s < n] + [n]
        self.cold = list(handler)
        for a, b in zip(starts, starts[1:]):
            if any(self.ins[k].op.startswith("CALL") for k in range(a, b)):
                for k in range(a, b):
                    self.cold[k] = True
        # LayerNorm's two-pass fallback: the code a conditional branch skips right after a
        # vote of the block (BAR.RED.OR: syncthreads_or) or the warp (VOTE.ANY: any_sync)
        self.rare = [False] * n
        for k, i in enumerate(self.ins):
            if i.op.startswith(("BAR.RED.OR", "VOTE.ANY")):
                bra = next((j for j in range(k + 1, n) if self.ins[j].op.split(".")[0] in ("BRA", "EXIT", "BAR")
                            or j in self.label_idx), None)
                if bra is not None and self.ins[bra].op == "EXIT" and self.ins[bra].pred:
                    # the vote ends the kernel where it fails: what follows, to the next
                    # exit, runs where it passes (a pass after the rows)
                    end = next((j for j in range(bra + 1, n) if self.ins[j].op == "EXIT" and not self.ins[j].pred), n)
                    for j in range(bra + 1, end):
                        self.rare[j] = True
                    continue
                if bra is None or self.ins[bra].op != "BRA" or not self.ins[bra].pred:
                    continue
                t = self.index_of.get(_target(self.ins[bra]))
                if t is not None and t > bra:
                    for j in range(bra + 1, t):
                        self.rare[j] = True

    def row_loop(self):
        """(first, last) instruction of the row loop, or None: of the outermost loops
        with a global access, the longest (a prologue may loop too, e.g. zeroing the
        long-row path's partial sums)."""
        # (not a loop in a vote's rare branch: a kernel's pass over its rows again, after
        # them, for the rows a vote found out of range)
        found = [L for L in self.loops if self.global_accesses(*L) and not self.rare[L[0]]]
        outer = [L for L in found if not any(o != L and o[0] <= L[0] and L[1] <= o[1] for o in found)]
        return max(outer, key=lambda L: L[1] - L[0], default=None)

    def _children(self, a, b):
        """The outermost loops strictly inside [a, b]."""
        inner = [(x, y) for x, y in self.loops if a <= x and y <= b and (x, y) != (a, b)]
        return [L for L in inner if not any(o != L and o[0] <= L[0] and L[1] <= o[1] for o in inner)]

    def weighted(self, a, b, iterations, weight):
        """Sum of ``weight(k)`` over one pass of [a, b], slow-path blocks left out and
        inner loops multiplied by ``iterations(loop)``, their iterations per entry."""
        total = 0.0
        kids = self._children(a, b)
        k = a
        while k <= b:
            kid = next((L for L in kids if L[0] == k), None)
            if kid is not None:
                total += self.weighted(*kid, iterations, weight) * iterations(kid)
                k = kid[1] + 1
                continue
            if not self.cold[k]:
                total += weight(k)
            k += 1
        return total

    def count(self, a, b, iterations, rare=False):
        """Instructions one warp issues in one pass over [a, b]: the common path, or
        (``rare``) only the fallback's (``self.rare``)."""
        return self.weighted(a, b, iterations, lambda k: 1 if self.rare[k] == rare else 0)

    def widest_global(self, a, b, kind="LDG"):
        bits = [global_bits(self.ins[k].op) for k in range(a, b + 1) if self.ins[k].op.split(".")[0] == kind]
        return max(bits, default=0)

    def global_bytes(self, a, b, iterations, kind="LDG"):
        """Bytes one warp's global loads (``kind``) request in one pass over [a, b]."""
        def size(k):
            op = self.ins[k].op
            return 32 * global_bits(op) / 8 if op.split(".")[0] == kind and not self.rare[k] else 0

        return self.weighted(a, b, iterations, size)

    # a kernel that stages its long rows in shared memory: its loops over the
    # row's words may access shared memory only (the passes after the first)
    staged = False

    def global_accesses(self, a, b):
        """Row accesses in [a, b]: global ones (and shared ones in a staged kernel)."""
        shared = ("LDS", "STS") if self.staged else ()
        return sum(_is_global(self.ins[k].op) or self.ins[k].op.split(".")[0] in shared for k in range(a, b + 1))

    def loop_kind(self, loop):
        """'words' (global accesses, or shared ones in a staged kernel: a loop over the
        row), 'partials' (shared loads only: the cross-warp step of a reduction), or
        'other'."""
        ops = [self.ins[k].op.split(".")[0] for k in range(loop[0], loop[1] + 1)]
        if any(o in ("LDG", "STG", "RED", "ATOMG") for o in ops) or (self.staged and "LDS" in ops):
            return "words"
        if "LDS" in ops:
            return "partials"
        return "other"

    def unroll_words(self, loop, step):
        """Source iterations per pass of a word loop, from its immediate additions to
        the word index (multiples of ``step``, the threads per row): their sum where
        each copy steps from the last (q += step, four times), their largest where
        the copies offset one base (q + step, q + 2 step, ...) -- whichever divides
        the loop's global accesses (each copy makes the same ones), the sum first."""
        steps = []
        for k in range(loop[0], loop[1] + 1):
            i = self.ins[k]
            if i.op in ("IADD3", "VIADD", "IMAD.IADD"):
                for arg in i.args.split(",")[1:]:
                    v = _imm(arg)
                    if v and step and v > 0 and v % step == 0 and v // step <= 16:
                        steps.append(v // step)
        accesses = self.global_accesses(*loop)
        for u in (sum(steps), max(steps, default=1)):
            if 1 <= u <= accesses and accesses % u == 0:
                return u
        return max(1, sum(steps))

    def unroll_partials(self, loop):
        """Source iterations per pass of a loop over warp partials: its shared loads
        over their distinct offsets (one offset per value reduced)."""
        offs = []
        for k in range(loop[0], loop[1] + 1):
            i = self.ins[k]
            if i.op.split(".")[0] == "LDS":
                m = re.search(r"\[[^\]+]*(?:\+(0x[0-9a-f]+|\d+))?\]", i.args)
                offs.append(m.group(1) if m else None)
        return max(1, len(offs) // max(1, len(set(offs))))

    def loads_in_flight(self, a, b):
        """The most bytes (per thread) of global loads in flight at once in [a, b]: issued
        and not yet waited for.  A load is waited for where an instruction first reads
        (or overwrites) one of its destination registers -- the scoreboard wait -- and
        only that load: branches, labels and barriers do not wait for loads.  [a, b] is
        scanned twice, so that loads one iteration leaves in flight for the next count;
        the fallback's and the slow paths' instructions are left out."""
        pending, size, best = {}, {}, 0   # register -> load, load -> bytes
        for _ in range(2):
            for k in range(a, b + 1):
                if self.cold[k] or self.rare[k]:
                    continue
                i = self.ins[k]
                base = i.op.split(".")[0]
                if base == "EXIT" and not i.pred:
                    pending.clear()
                    size.clear()
                    continue
                reads, writes = _registers(i)
                for load in {pending[r] for r in reads | writes if r in pending}:
                    del size[load]
                    for r in [r for r, v in pending.items() if v == load]:
                        del pending[r]
                if base == "LDG" and writes:
                    size[k] = global_bits(i.op) // 8
                    for r in writes:
                        pending[r] = k
                best = max(best, sum(size.values()))
        return best


_REG = re.compile(r"(?<![\w.])R(\d+)(\.64)?")
_NO_DESTINATION = ("ST", "STG", "STS", "STL", "RED", "BRA", "BAR", "EXIT", "RET", "CALL", "BSSY", "BSYNC",
                   "SYNCS", "MEMBAR", "DEPBAR", "NOP", "WARPSYNC", "ATOMS")


def _registers(i):
    """(registers read, registers written) by an instruction (as their numbers): its
    first operand is its destination unless it is a store or a branch, a ``.64`` operand
    is a register pair, and a load writes as many registers as it moves 32-bit words."""
    ops = [o.strip() for o in i.args.split(",")]
    base = i.op.split(".")[0]
    writes = set()
    if ops and base not in _NO_DESTINATION:
        m = _REG.match(ops[0])
        if m:
            first = int(m.group(1))
            n = max(1, global_bits(i.op) // 32) if base in ("LDG", "LDS", "LD", "LDL") else 2 if m.group(2) else 1
            if "WIDE" in i.op or i.op.startswith(("DADD", "DMUL", "DFMA", "F2F.F64", "I2F.F64")):
                n = 2
            writes = set(range(first, first + n))
            ops = ops[1:]
    reads = set()
    for o in ops:
        for m in _REG.finditer(o):
            r = int(m.group(1))
            reads |= {r, r + 1} if m.group(2) else {r}
    return reads, writes


# ---------------------------------------------------------------- the model's arithmetic

def occupancy(regs, block, smem):
    """Resident threads per SM for a kernel of ``regs`` registers per thread,
    ``block`` threads per block and ``smem`` bytes of shared memory per block."""
    warps = cdiv(block, 32)
    per_warp = cdiv(max(regs, 1) * 32, REGISTER_UNIT) * REGISTER_UNIT
    limits = [(REGISTERS_PER_SM // per_warp) // warps, THREADS_PER_SM // block, BLOCKS_PER_SM]
    if smem:
        limits.append(SMEM_PER_SM // (smem + SMEM_RESERVED_PER_BLOCK))
    return max(0, min(limits)) * block


def resident_threads(occupied, grid, block):
    """Threads an SM holds at once: what registers and shared memory allow (``occupied``),
    or fewer where the grid has fewer blocks per SM (the persistent grids: one wave of
    the blocks their launch bounds guarantee)."""
    return min(occupied, cdiv(grid, SMS) * block)


def hbm_fraction(bytes_in_flight_per_sm):
    """Little's law: the fraction of DRAM_BYTES_PER_S that SMS SMs each keeping
    ``bytes_in_flight_per_sm`` in flight reach at LATENCY_S (model)."""
    return min(1.0, bytes_in_flight_per_sm * SMS / (DRAM_BYTES_PER_S * LATENCY_S))


# The device run the model is calibrated on (benchmarks/results/): its row kernels' measured
# fraction of the copy against this model's issue/memory ratio for the same kernels
CALIBRATION_RUN = "gpu-h200-b.json"


def calibration(run):
    """Fit ``fraction = 1 / (1 + a * ratio)`` to a ``benchmarks.gpu_check`` run's ``model``
    rows (measured fraction of the copy, this model's issue/memory ratio): least squares on
    1/fraction - 1, through the origin.  On the H200 the uncalibrated model said 1.00 for
    every row kernel (its memory and issue clocks overlap perfectly, and every kernel keeps
    enough in flight): issue time does not hide behind memory time.  Returns
    ``{"a", "rms", "worst", "rows", "run"}`` (errors in-sample, in fraction of the copy).  Rows
    of calls of several launches (GroupNorm's backward) are left out: the main launch's ratio
    is not theirs."""
    rows = [m for m in run.get("model", []) if m.get("model_issue_memory_ratio") is not None
            and m.get("measured_fraction_of_copy") and m.get("single_launch", True)]
    if not rows:
        return None
    ratio = np.array([m["model_issue_memory_ratio"] for m in rows])
    frac = np.array([m["measured_fraction_of_copy"] for m in rows])
    a = float(ratio @ (1 / frac - 1) / (ratio @ ratio))
    err = 1 / (1 + a * ratio) - frac
    return {"a": round(a, 4), "rms": round(float(np.sqrt(np.mean(err ** 2))), 4),
            "worst": round(float(np.max(np.abs(err))), 4), "rows": len(rows), "run": run.get("device")}


def calibrated_fraction(ratio, a):
    """The calibrated model's fraction of the copy a kernel of this issue/memory ratio reaches."""
    return 1 / (1 + a * ratio)


def issue_memory_ratio(warp_instructions_per_row, bytes_per_row):
    """Issue clocks per row over DRAM clocks per row (model): both per SM, so the
    SM count cancels."""
    if bytes_per_row <= 0:
        return math.inf
    return (warp_instructions_per_row / ISSUE_PER_CLOCK) / (bytes_per_row / BYTES_PER_CLOCK)


def gate_failures(records, strict=False, spill_budget=None):
    """Reasons the records fail the CI gate.

    Always: no kernel spills more than ``spill_budget`` bytes.  ``strict`` (the
    issues' gate): no spill at all; every LayerNorm/RMSNorm row kernel (and the fused
    ones) at N <= 8192 at issue_memory_ratio <= 0.6, the 16-bit ones with 128-bit
    loads; GroupNorm's launches that stream rows (its forward, and the backward's
    channel sums and dx) likewise; and all of these at 1024 <= N <= 8192 keep
    IN_FLIGHT_MIN bytes of their row arrays in flight per SM, with every one of those
    loads issued before the first wait in the SASS.
    """
    budget = 0 if strict else spill_budget
    out = []
    for r in records:
        tag = f"{r['kernel']}/{r['launch']} {r['dtype']} N={r['N']}"
        if budget is not None and r["spill_bytes"] > budget:
            out.append(f"{tag}: spills {r['spill_bytes']} bytes (budget {budget})")
        rows = r["kernel"] in GATED and r["launch"] == "main"
        groups = r["kernel"] in GATED_GROUPS and r["launch"] in ("main", "channel_sums")
        if not strict or not (rows or groups) or r["N"] > 8192:
            continue
        if r["dtype"] in ("float16", "bfloat16") and r["global_load_bits"] < 128:
            out.append(f"{tag}: widest row load {r['global_load_bits']} bits < 128")
        if r["issue_memory_ratio"] > ISSUE_LIMIT:
            out.append(f"{tag}: issue/memory {r['issue_memory_ratio']:.2f} > {ISSUE_LIMIT}")
        if r["N"] >= 1024:
            design, sass = r.get("row_bytes_in_flight_per_thread"), r.get("sass_bytes_in_flight_per_thread")
            if design is not None and sass is not None and sass < design:
                out.append(f"{tag}: the SASS has {sass} bytes in flight per thread, fewer than the "
                           f"{design} its row loads are")
            if r.get("row_bytes_in_flight_per_sm", 0) < IN_FLIGHT_MIN:
                out.append(f"{tag}: {r.get('row_bytes_in_flight_per_sm', 0)} bytes in flight per SM "
                           f"< {IN_FLIGHT_MIN}")
    return out


# ---------------------------------------------------------------- driving the launchers without a GPU

# shared: dynamic shared bytes per block; itemsize: of x's elements (0: not known at the launch)
Launch = namedtuple("Launch", "kernel grid block args shared itemsize", defaults=(0,))


class _DeviceLike(np.ndarray):
    """NumPy memory that numbanorm's CUDA backend takes for a numba device array.

    Its pages are never touched (nothing runs), so even rows of 4 GB cost no RAM.
    """

    __cuda_ndarray__ = True
    stream = 0

    def is_c_contiguous(self):
        return self.flags.c_contiguous


def _device_empty(shape, dtype=np.float64, *args, **kwargs):
    return np.empty(shape, dtype).view(_DeviceLike)


@contextlib.contextmanager
def offline(cc=CC):
    """numbanorm's CUDA launch path with no GPU: an H100's SM count and compute
    capability, stand-in device arrays, and ``common.launch`` recording into the
    list this yields instead of launching."""
    from numba import cuda
    from numba.cuda import dispatcher

    from numbanorm.cuda._kernels import common as C

    class _Device:  # device functions ask the current device for its capability
        compute_capability = cc
        MULTIPROCESSOR_COUNT = SMS

    launches = []

    def record(kernel, grid, block, stream, *args, shared=0):
        launches.append(Launch(kernel, grid, block, C.arrays(args), shared))

    patches = [(dispatcher, "get_current_device", lambda: _Device()), (C, "n_sm", lambda: SMS),
               (C, "device_count", lambda: 1),
               (C, "launch", record), (C, "bfloat16_unsupported", lambda: ""),
               (cuda, "device_array", _device_empty)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    C.row_config.cache_clear()
    C._dummy_cached.cache_clear()
    try:
        yield launches
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
        C.row_config.cache_clear()
        C._dummy_cached.cache_clear()


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def inputs(kernel, dtype, M, N, shape=None):
    """Arguments of the public function ``kernel`` for M rows of N elements (stand-ins);
    GroupNorm's at ``shape`` (N, C, H, W) in GN_GROUPS groups instead, where given."""
    dt, acc = _dtype(dtype), np.dtype(np.float32)

    def E(shape, d=dt):
        return _device_empty(shape, d)

    op = _op_of(kernel)
    if op.layout == "groups":
        n, c, s, g = ((shape[0], shape[1], math.prod(shape[2:]), GN_GROUPS) if shape is not None
                      else (M // GROUPS, CHANNELS, N * GROUPS // CHANNELS, GROUPS))
        big, param, stat, role = (n, c, s), (c,), (n, g), g
    else:
        big, param, stat, role = (M, N), (N,), (M, 1), (N,)
    made = {"weight": lambda: E(param), "bias": lambda: E(param), "mean": lambda: E(stat, acc),
            "rstd": lambda: E(stat, acc), op.shape_role: lambda: role}  # (normalized_shape, num_groups)
    roles = op.forward_roles if kernel == op.functions[1] else op.backward_roles
    # by the table's roles: the big arrays (x, residual, dy, ds, s), the parameters, the statistics;
    # eps is left to its default
    return tuple(made.get(r, lambda: E(big))() for r in roles if r != "eps")


def frontend():
    from numbanorm import _api
    from numbanorm.cuda import _backend

    # every call through the full path (a replay would skip the launchers this records)
    return _api.Frontend(_backend, plans=False)


def capture(fe, launches, kernel, dtype, M, N, shape=None):
    """The launches the public function ``kernel`` makes for M rows of N elements (``inputs``)."""
    del launches[:]
    getattr(fe, kernel)(*inputs(kernel, dtype, M, N, shape))
    return [ln._replace(itemsize=_dtype(dtype).itemsize) for ln in launches]


def signature(args):
    """numba types of a launch's arguments (the launchers pass C-contiguous arrays)."""
    import numba

    return tuple(numba.typeof(np.asarray(a)) if isinstance(a, np.ndarray) else numba.typeof(a) for a in args)


def kernel_factories():
    """The kernel factories (cached functions returning kernels) of numbanorm.cuda._kernels."""
    import pkgutil

    import numbanorm.cuda._kernels as pkg

    out = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if "kernel" in name and hasattr(obj, "cache_info") and getattr(obj, "__module__", "") == mod.__name__:
                out.append(obj)
    return out


def sweep_compiles(fe, launches, kernel, Ms=SWEEP_MS, N=SWEEP_N, dtype=SWEEP_DTYPE):
    """``(factory cache entries, distinct kernels launched)`` for ``kernel`` over M in
    ``Ms`` at N, dtype: each is a kernel numba compiles on first launch."""
    factories = kernel_factories()
    for f in factories:
        f.cache_clear()
    seen = set()
    for M in Ms:
        for ln in capture(fe, launches, kernel, dtype, M, N):
            seen.add((id(ln.kernel), signature(ln.args)))
    return sum(f.cache_info().currsize for f in factories), len(seen)


# ---------------------------------------------------------------- compiling

Compiled = namedtuple("Compiled", "sass registers spill_bytes stack_bytes shared_bytes")
_COMPILED = {}   # per process: the same kernel serves several records (column sums, casts)


def tools():
    """(ptxas, nvdisasm) paths, or None for a missing one."""
    from numbanorm.cuda import _ptx

    return _ptx.find_tool("ptxas"), _ptx.find_tool("nvdisasm")


def resources(log):
    """registers, spilled bytes (stores + loads), stack frame and static shared
    memory from a ``ptxas -v`` log."""
    def first(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return (first(r"Used (\d+) registers"), spills, first(r"(\d+) bytes stack frame"),
            first(r"(\d+) bytes smem"))


def _ident(v, depth=0):
    """A text naming a kernel's specialization: its function and closure, recursively."""
    fn = getattr(v, "py_func", None)
    if fn is not None:  # a dispatcher: its function and compile options
        return f"jit{sorted(v.targetoptions.items())!r}:{_ident(fn, depth)}"
    if callable(v) and hasattr(v, "__code__") and depth < 6:
        inner = ",".join(f"{n}={_ident(c, depth + 1)}" for n, c in _closure(v).items())
        return f"{v.__module__}.{v.__qualname__}({inner})"
    if isinstance(v, tuple):
        return "(" + ",".join(_ident(x, depth + 1) for x in v) + ")"
    return f"{type(v).__qualname__}:{v!r}"


def _sources_hash():
    import numbanorm.cuda._kernels as pkg

    h = hashlib.sha256()
    for root in pkg.__path__:
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                with open(os.path.join(root, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h


def kernel_sources():
    """sha256 of the GPU kernel modules' sources (numbanorm/cuda/_kernels/*.py): says
    which kernels a results file describes."""
    return _sources_hash().hexdigest()


def _cache_key(kernel, sig, cc):
    h = _sources_hash()
    h.update(repr((_ident(kernel), [str(t) for t in sig], cc, sorted(_versions().items()))).encode())
    return h.hexdigest()[:32]


def compile_kernel(kernel, sig, cc=CC, cache_dir=None):
    """Compile one kernel as numba-cuda would for a launch with argument types ``sig``.

    ``cache_dir``: reuse (and keep) SASS compiled by an earlier run for the same
    kernel sources, specialization, argument types and toolchain versions.
    """
    key = (id(kernel), sig)
    path = None
    if key not in _COMPILED and cache_dir:
        path = os.path.join(cache_dir, _cache_key(kernel, sig, cc) + ".json")
        try:
            with open(path) as f:
                _COMPILED[key] = (kernel, Compiled(**json.load(f)))
        except (OSError, ValueError, TypeError):  # not there (or not this version's): compile
            pass
    if key not in _COMPILED:
        from numba import cuda

        from numbanorm.cuda import _ptx

        bounds = kernel.targetoptions.get("launch_bounds")
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc, launch_bounds=bounds)
        cubin, log = _ptx.assemble(ptx, cc)
        with tempfile.TemporaryDirectory() as d:
            binary = os.path.join(d, "k.cubin")
            with open(binary, "wb") as f:
                f.write(cubin)
            sass = subprocess.run([tools()[1], "-c", binary], capture_output=True, text=True, check=True).stdout
        _COMPILED[key] = (kernel, Compiled(sass, *resources(log)))  # the kernel keeps its id unique
        if path:
            os.makedirs(cache_dir, exist_ok=True)
            with open(path + f".{os.getpid()}", "w") as f:
                json.dump(_COMPILED[key][1]._asdict(), f)
            os.replace(path + f".{os.getpid()}", path)  # whole, for a run reading it at the same time
    return _COMPILED[key][1]


# ---------------------------------------------------------------- records

def _closure(fn):
    return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def _closure_mapping(clo):
    """The mapping of a row kernel that does not carry one (as the kernels before they did,
    for a before/after model): from its closure's constants, or None."""
    if "TPR" not in clo:
        return None
    from numbanorm.cuda._kernels.common import Mapping

    # (a kernel that names no LOOP goes over its rows' words in loops)
    return Mapping(clo["TPR"], clo.get("VPT", clo.get("V", 1)), clo.get("R", 1), bool(clo.get("LOOP", True)),
                   clo.get("BLOCK", clo["TPR"]), clo.get("V", 1), bool(clo.get("STAGED")))


def _first_exit(sass, start):
    for k in range(start, len(sass.ins)):
        if sass.ins[k].op == "EXIT" and not sass.ins[k].pred:
            return k
    return len(sass.ins) - 1


def _unique_bytes(args):
    seen = {}
    for a in args:
        if isinstance(a, np.ndarray):
            seen[(a.__array_interface__["data"][0], a.nbytes)] = a.nbytes
    return sum(seen.values())


def analyse(launch, compiled):
    """The model's figures for one launch (totals over the launch; see the module docstring)."""
    sass = Sass(compiled.sass)
    kern = launch.kernel
    clo = _closure(kern.py_func)
    mapping = getattr(kern, "mapping", None) or _closure_mapping(clo)  # what a row kernel was compiled for
    depth = getattr(kern, "rows_in_flight", 1)  # rows a row group loads, and works on, per iteration
    sass.staged = bool(mapping and mapping.stage)
    tpr = mapping.tpr if mapping else None
    rows2d = next((a for a in launch.args if isinstance(a, np.ndarray) and a.ndim == 2), None)
    warps_per_block = cdiv(launch.block, 32)
    warps = launch.grid * warps_per_block
    if tpr and rows2d is not None:           # a row kernel: one row group per row
        rows, words = rows2d.shape
        # a 16-byte word is two of the kernel's uint64 elements
        per_word = 2 if rows2d.dtype == np.uint64 and mapping.vec * launch.itemsize == 16 else 1
        step, trips = tpr, cdiv(words // per_word, tpr)
        partial_trips = max(0, tpr // 32 - 1)
    else:                                    # column sums (a loop over partial rows) or a cast
        step = clo.get("SLICES", 1)
        part = next((a for a in launch.args if isinstance(a, np.ndarray) and a.ndim == 3), None)
        trips = cdiv(part.shape[1], step) if part is not None else 1
        partial_trips = max(0, step - 1)
        rows = words = None
    unresolved = []
    # a loop before the rows over the weights (GroupNorm's forward: the least weight), one
    # trip a block's threads
    weights = launch.args[1] if getattr(kern, "weights_loop", False) else None

    def iterations(loop):
        kind = sass.loop_kind(loop)
        if kind == "words" and weights is not None and row_loop and loop[1] < row_loop[0]:
            return cdiv(len(weights), launch.block)
        if kind == "words" and mapping is not None and not mapping.loop:
            # a row held in registers has no loop over its words: this one goes over
            # something else per row (GroupNorm's dx: the group's channels' sums, one
            # trip for the CHANNELS / GROUPS <= threads per row of the model's inputs)
            return 1.0
        if kind == "words":
            if any(sass.loop_kind(inner) == "words" for inner in sass._children(*loop)):
                return 1.0  # nested word loops (channels, then their words): the inner one takes the trips
            unroll = sass.unroll_words(loop, step)
            if unroll > sass.global_accesses(*loop):
                unresolved.append(sass.ins[loop[0]].addr)  # more steps than accesses: not a word index
            return trips / unroll
        if kind == "partials":
            return partial_trips / sass.unroll_partials(loop)
        unresolved.append(sass.ins[loop[0]].addr)
        return 1.0

    row_loop = sass.row_loop() if rows is not None else None
    end = _first_exit(sass, row_loop[1] if row_loop else 0)
    if row_loop:
        a, b = row_loop
        # an iteration of the row loop is ``depth`` rows of the row group: counts per row
        per_row = sass.count(a, b, iterations) / depth
        fallback = sass.count(a, b, iterations, rare=True) / depth
        outside = sass.count(0, a - 1, iterations) + sass.count(b + 1, end, iterations)
        warp_rows = rows * tpr / 32           # warp-rows of the launch
        total = warp_rows * per_row + warps * outside
        requested = warp_rows * sass.global_bytes(a, b, iterations) / depth
        span = (a, b)
    else:
        per_row = outside = sass.count(0, end, iterations)
        fallback = 0.0
        total = warps * per_row
        requested = warps * sass.global_bytes(0, end, iterations)
        span = (0, end)
    occupied = occupancy(compiled.registers, launch.block, compiled.shared_bytes + launch.shared)
    resident = resident_threads(occupied, launch.grid, launch.block)
    in_flight = sass.loads_in_flight(*span)
    design = getattr(kern, "loads_in_flight", None)  # the kernel's own count: its row arrays' bytes
    row_in_flight = resident * (in_flight if design is None else min(design, in_flight))
    return {
        "grid": launch.grid,
        "block": launch.block,
        "threads_per_row": tpr,
        "rows_per_block": mapping.rows if mapping else None,
        "elements_per_thread": mapping.vpt if mapping else None,
        "elements_per_word": mapping.vec if mapping else None,
        "loop_path": mapping.loop if mapping else None,
        "rows_in_flight": depth if mapping else None,
        "row_staged": sass.staged,            # a long row copied to shared memory: global memory read once
        "launch_rows": rows,
        "row_words": words,
        "registers": compiled.registers,
        "spill_bytes": compiled.spill_bytes,
        "stack_bytes": compiled.stack_bytes,
        "shared_bytes": compiled.shared_bytes,
        "dynamic_shared_bytes": launch.shared,  # a staged long row's copies, sized per call
        "global_load_bits": sass.widest_global(*span, "LDG"),
        "global_store_bits": sass.widest_global(*span, "STG"),
        "loop_instructions": round(per_row, 1),
        "fallback_instructions": round(fallback, 1),  # per row group that takes LayerNorm's two-pass
        "outside_loop_instructions": round(outside, 1),
        "unresolved_loops": sorted({hex(x) for x in unresolved}),
        "_total_instructions": total,
        "_total_bytes": _unique_bytes(launch.args),
        "_requested_bytes": requested,
        "occupancy_threads_per_sm": occupied,
        "resident_threads_per_sm": resident,
        "waves": round(launch.grid / max(1, SMS * (occupied // launch.block)), 2) if occupied else None,
        "sass_bytes_in_flight_per_thread": in_flight,
        "row_bytes_in_flight_per_thread": design,
        "bytes_in_flight_per_sm": resident * in_flight,
        "row_bytes_in_flight_per_sm": row_in_flight,
        "hbm_fraction_estimate": round(hbm_fraction(row_in_flight), 3),
    }


def records_for(fe, launches, kernel, dtype, N, M=M_ROWS, sass_dir=None, written=None, cache_dir=None,
                shape=None):
    """One record per distinct launch of ``kernel`` (identical launches merged, ``count``);
    GroupNorm's at ``shape`` (``inputs``), whose M (sample, group) rows of N elements the
    caller gives."""
    groups = {}
    for ln in capture(fe, launches, kernel, dtype, M, N, shape):
        sig = signature(ln.args)
        key = (id(ln.kernel), sig, ln.grid, ln.block, ln.shared)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [ln, 1, sig]
    out = []
    for ln, count, sig in groups.values():
        compiled = compile_kernel(ln.kernel, sig, cache_dir=cache_dir)
        r = {"kernel": kernel, "launch": ln.kernel.py_func.__name__, "dtype": dtype, "N": N, "M": M,
             **({"shape": list(shape)} if shape else {}), "count": count, **analyse(ln, compiled)}
        r["_total_instructions"] *= count
        r["_total_bytes"] *= count
        r["_requested_bytes"] *= count
        r["_sass"] = compiled.sass
        out.append(r)
    main_rec = max(out, key=lambda r: r["_total_bytes"])
    for r in out:
        if r is main_rec:
            r["launch"] = "main"
        elif r["launch"].endswith("_kernel"):
            r["launch"] = r["launch"][: -len("_kernel")]
        tot, nbytes = r.pop("_total_instructions"), r.pop("_total_bytes")
        r["warp_instructions_per_row"] = round(tot / M, 1)
        r["bytes_per_row"] = round(nbytes / M, 1)
        r["load_bytes_per_row"] = round(r.pop("_requested_bytes") / M, 1)
        r["issue_clocks_per_row"] = round(tot / M / ISSUE_PER_CLOCK, 2)
        r["memory_clocks_per_row"] = round(nbytes / M / BYTES_PER_CLOCK, 2)
        r["issue_memory_ratio"] = round(issue_memory_ratio(tot / M, nbytes / M), 3)
        sass = r.pop("_sass")
        r["sass"] = None
        if sass_dir is not None:
            name = written.get(sass)
            if name is None:
                name = f"{kernel}.{r['launch']}.{dtype}.N{N}{'.M%d' % M if shape else ''}.sass"
                with open(os.path.join(sass_dir, name), "w") as f:
                    f.write(sass)
                written[sass] = name
            r["sass"] = name
    return out


# ---------------------------------------------------------------- the tool

COLUMNS = (("kernel", "{:<24}"), ("launch", "{:<12}"), ("dtype", "{:<8}"), ("N", "{:>6}"),
           ("threads_per_row", "{:>4}"), ("registers", "{:>4}"), ("spill_bytes", "{:>5}"),
           ("global_load_bits", "{:>4}"), ("loop_instructions", "{:>8}"), ("bytes_per_row", "{:>9}"),
           ("issue_memory_ratio", "{:>6}"), ("resident_threads_per_sm", "{:>5}"),
           ("row_bytes_in_flight_per_sm", "{:>7}"), ("hbm_fraction_estimate", "{:>5}"))
HEADS = ("kernel", "launch", "dtype", "N", "tpr", "regs", "spill", "ld", "instr/row", "DRAM B/row",
         "ratio", "thr/SM", "B/SM", "HBM")


def table(records):
    lines = [" ".join(fmt.format(h)[: max(len(fmt.format(h)), 4)] for (_, fmt), h in zip(COLUMNS, HEADS))]
    for r in records:
        lines.append(" ".join(fmt.format("-" if r[k] is None else r[k]) for k, fmt in COLUMNS))
    return "\n".join(lines)


def _versions():
    from importlib import metadata

    out = {}
    for dist in ("numba", "numba-cuda", "nvidia-nvvm", "nvidia-cuda-nvcc", "nvidia-cuda-nvdisasm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def unavailable():
    """Why the tool cannot run here ('' when it can)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "the CUDA simulator is on: set NUMBA_ENABLE_CUDASIM=0"
    ptxas, nvdisasm = tools()
    if not ptxas or not nvdisasm:
        return "ptxas and nvdisasm are needed (pip install numbanorm[test]: nvidia-cuda-nvcc, nvidia-cuda-nvdisasm)"
    from numba import cuda

    try:
        cuda.compile_ptx(lambda a: None, (cuda.types.float32[::1],), cc=CC)
    except Exception as e:  # libnvvm missing
        return f"NVVM cannot compile: {type(e).__name__}: {str(e).splitlines()[0]}"
    return ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="write the records here")
    p.add_argument("--sass-dir", required=True, help="write each kernel's SASS here")
    p.add_argument("--quick", action="store_true", help="float16 at N = 8192 only (tests)")
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated public names "
                   "('gated': the gate's LayerNorm/RMSNorm kernels and their fused forms)")
    p.add_argument("--ns", help="comma-separated row lengths (default: %s)" % ",".join(map(str, NS)))
    p.add_argument("--dtypes", help="comma-separated dtypes (default: %s)" % ",".join(DTYPES))
    p.add_argument("--cache", metavar="DIR", help="reuse SASS an earlier run compiled (same sources, "
                   "specialization and toolchain) and keep what this run compiles")
    p.add_argument("--gate", action="store_true",
                   help="the gate: no spill; LayerNorm/RMSNorm row kernels (and fused) and GroupNorm's row "
                        "launches at N <= 8192 at issue/memory <= 0.6, 16-bit ones with 128-bit loads, and at "
                        "1024 <= N <= 8192 with 40 KB of row data in flight per SM")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"gpu_model: cannot run: {why}")
        return 3
    kernels = [g for k in args.kernels.split(",") if k for g in (GATED if k == "gated" else (k,))]
    bad = sorted(set(kernels) - set(KERNELS))
    if bad:
        p.error(f"unknown kernels {bad}; known: {', '.join(KERNELS)}")
    ns, dtypes = ((8192,), ("float16",)) if args.quick else (NS, DTYPES)
    if args.ns:
        ns = tuple(int(n) for n in args.ns.split(","))
    if args.dtypes:
        dtypes = tuple(args.dtypes.split(","))
    os.makedirs(args.sass_dir, exist_ok=True)
    from numbanorm.cuda import _ptx

    fe = frontend()
    print("MODEL, not a measurement: H100 SXM, 132 SMs at 1.98 GHz, 3.0 TB/s (11.48 B/clock/SM), "
          f"4 warp instructions/clock/SM, {LATENCY_S * 1e6:.1f} us loaded DRAM latency (assumed); every figure "
          "below is derived from the SASS", flush=True)
    records, written = [], {}
    with offline() as launches:
        # first, before the records' kernels are cached: the factories start empty
        sweep_ms = range(1, 257) if args.quick else SWEEP_MS
        by_kernel = {}
        for k in [k for k in SWEEP_KERNELS if k in kernels][: 1 if args.quick else None]:
            by_kernel[k] = dict(zip(("factory_cache_entries", "kernels_launched"),
                                    sweep_compiles(fe, launches, k, sweep_ms)))
        for k in kernels:
            for dt in dtypes:
                for n in ns:
                    for r in records_for(fe, launches, k, dt, n, sass_dir=args.sass_dir, written=written,
                                         cache_dir=args.cache):
                        records.append(r)
                        print(table([r]).splitlines()[1] if len(records) > 1 else table([r]), flush=True)
        shaped = []  # GroupNorm at GN_SHAPES (a full run's: not with --quick or --ns)
        for k in [k for k in kernels if _op_of(k).layout == "groups" and not (args.quick or args.ns)]:
            for dt in dtypes:
                for shape in GN_SHAPES:
                    L = shape[1] // GN_GROUPS * math.prod(shape[2:])
                    for r in records_for(fe, launches, k, dt, L, M=shape[0] * GN_GROUPS, sass_dir=args.sass_dir,
                                         written=written, cache_dir=args.cache, shape=shape):
                        shaped.append(r)
                        print(table([r]).splitlines()[1], flush=True)
    head = "layer_norm_forward" if "layer_norm_forward" in by_kernel else next(iter(by_kernel), None)
    out = {
        "model": MODEL,
        "toolchain": _versions(),
        "kernel_sources_sha256": kernel_sources(),
        "M": M_ROWS,
        "records": records,
        "group_shapes_records": shaped,
        "compiles_for_M_sweep": by_kernel[head]["factory_cache_entries"] if head else None,
        "compiles_for_M_sweep_kernel": head,
        "compiles_for_M_sweep_Ms": [sweep_ms.start, sweep_ms.stop - 1],
        "compiles_for_M_sweep_by_kernel": by_kernel,
    }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"compiles for the M sweep (M = {sweep_ms.start}..{sweep_ms.stop - 1}, N = {SWEEP_N}, "
          f"{SWEEP_DTYPE}): {by_kernel}")
    failures = gate_failures(records + shaped, strict=args.gate, spill_budget=_ptx.SPILL_BYTES)
    for line in failures:
        print("GATE:", line)
    print(f"{len(records) + len(shaped)} records (a model, not a measurement) -> {args.json}; "
          f"{'gate failed' if failures else 'gate passed'} ({'strict' if args.gate else 'spill budget'})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
