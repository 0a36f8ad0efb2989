"""A shared-memory race check for numba-cuda's CUDA simulator, after compute-sanitizer's
racecheck and initcheck (which need a GPU).

Inside ``racecheck()``, every ``cuda.shared.array`` of a simulated kernel (static, and the
dynamic one) is a ``Tracked`` view that records each element read and write by byte:
which thread of which block made it, in which barrier interval (the count of
``syncthreads`` the thread has entered, which ``_simwarp`` keeps: every thread of a block
is in the same interval between two barriers).  Two accesses to one byte by two threads
of a block, at least one a write, in the same interval, are a hazard whatever order the
simulator's threads happened to run them in -- warp shuffles order no memory, so lanes of
one warp count as any two threads.  A read of a byte no thread of the block wrote is an
uninitialised read (a block's shared memory starts undefined on a GPU; the simulator
keeps static arrays across blocks and zeroes the dynamic one).

Only element accesses through indexing are seen (a kernel's own ``a[i]`` and
``_simvec``'s 16-byte words); the check finds hazards, it cannot prove their absence on
paths it does not run.
"""

import contextlib
import itertools
import sys
import threading
from typing import NamedTuple

import numpy as np

_launches = itertools.count()


class Hazard(NamedTuple):
    kind: str       # 'read after write', 'write after read', 'write after write', 'uninitialised read'
    block: tuple    # blockIdx
    threads: tuple  # (the earlier access's thread, this access's thread)
    interval: int   # barrier interval of both accesses
    offset: int     # byte offset in the shared allocation
    where: str      # file:line of this access in the kernel


class _Log:
    def __init__(self):
        self.lock = threading.Lock()
        self.blocks = {}   # (launch, blockIdx) -> {byte address: [writer, interval, {reader: interval}]}
        self.hazards = []
        self.seen = set()  # (kind, where): one report per kind and line


def _where():
    f = sys._getframe(3)
    while f is not None and (f.f_code.co_filename == __file__ or "numpy" in f.f_code.co_filename
                             or f.f_code.co_filename.endswith("_simvec.py")):
        f = f.f_back
    return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}" if f is not None else "?"


def _record(log, arr, addresses, write):
    """``addresses`` of ``arr`` (a ``Tracked`` array) read or written by the calling thread."""
    me = threading.current_thread()
    tid = getattr(me, "thread_id", None)
    if tid is None:  # outside a simulated kernel
        return
    block = tuple(me.blockIdx)
    interval = getattr(me, "_nn_barriers", 0)
    base, size = arr._nn_base, arr.itemsize
    with log.lock:
        mem = log.blocks.setdefault((arr._nn_launch, block), {})
        for first in addresses:
            for a in range(first, first + size):  # by byte: views of other dtypes share them
                cell = mem.get(a)
                kind = other = None
                if write:
                    if cell is None:
                        mem[a] = [tid, interval, {}]
                        continue
                    if cell[0] is not None and cell[0] != tid and cell[1] == interval:
                        kind, other = "write after write", cell[0]
                    else:
                        other = next((r for r, i in cell[2].items() if r != tid and i == interval), None)
                        kind = "write after read" if other is not None else None
                    cell[0], cell[1], cell[2] = tid, interval, {}
                else:
                    if cell is None or cell[0] is None:
                        kind, other = "uninitialised read", None
                        cell = mem[a] = [None, interval, {}]
                    elif cell[0] != tid and cell[1] == interval:
                        kind, other = "read after write", cell[0]
                    cell[2][tid] = interval
                if kind is not None:
                    where = _where()
                    if (kind, where) not in log.seen:
                        log.seen.add((kind, where))
                        log.hazards.append(Hazard(kind, block, (other, tid), interval, a - base, where))
                    break  # one report per access


def _addresses(view):
    """Byte addresses of every element of ``view``."""
    start = view.__array_interface__["data"][0]
    if view.ndim == 0:
        return [start]
    offsets = sum(np.indices(view.shape, dtype=np.int64)[k] * view.strides[k] for k in range(view.ndim))
    return (start + np.asarray(offsets).ravel()).tolist()


def _scalar_address(a, idx):
    """The byte address of ``a[idx]`` if it names one element, else None."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if len(idx) != a.ndim:
        return None
    addr = a.__array_interface__["data"][0]
    for i, n, s in zip(idx, a.shape, a.strides):
        if not isinstance(i, (int, np.integer)):
            return None
        i = int(i)
        addr += (i + n if i < 0 else i) * s
    return addr


class Tracked(np.ndarray):
    """A shared array whose element reads and writes go to the active check's log."""

    def __getitem__(self, idx):
        res = super().__getitem__(idx)
        log = _ACTIVE[0]
        if log is not None and not isinstance(res, np.ndarray):
            addr = _scalar_address(self, idx)
            if addr is not None:
                _record(log, self, [addr], False)
        return res

    def __setitem__(self, idx, value):
        super().__setitem__(idx, value)
        log = _ACTIVE[0]
        if log is None:
            return
        addr = _scalar_address(self, idx)
        if addr is not None:
            _record(log, self, [addr], True)
        else:
            _record(log, self, _addresses(np.ndarray.__getitem__(self, idx).view(np.ndarray)), True)

    def __array_finalize__(self, obj):  # views keep their allocation's start and launch
        self._nn_base = getattr(obj, "_nn_base", 0)
        self._nn_launch = getattr(obj, "_nn_launch", None)


_ACTIVE = [None]


@contextlib.contextmanager
def racecheck():
    """Simulated launches inside record their shared-memory accesses; yields the list of
    ``Hazard`` found (filled as the kernels run)."""
    from numbanorm.cuda import _simshared

    def tracked(shared, a):
        t = a.view(Tracked)
        t._nn_base = a.__array_interface__["data"][0]
        t._nn_launch = shared.__dict__.setdefault("_nn_launch", next(_launches))  # (one per launch)
        return t

    log = _Log()
    _simshared.view, _ACTIVE[0] = tracked, log
    try:
        yield log.hazards
    finally:
        _simshared.view, _ACTIVE[0] = None, None
