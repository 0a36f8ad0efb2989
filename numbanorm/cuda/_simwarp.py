"""Warp intrinsics for numba's CUDA simulator, with the hardware's semantics.

numba's simulator runs every thread of a block as a Python thread and has
``syncthreads`` (a block-wide barrier) but no warp-level operations, so a kernel
that shuffles cannot run in it.  ``install()`` adds what it lacks to the
simulator's stand-in for the ``cuda`` module (``FakeCUDAModule``) -- it never
replaces anything the simulator already has:

    shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync,
    syncwarp, activemask, lanemask_lt,
    all_sync, any_sync, eq_sync, ballot_sync, match_any_sync, match_all_sync

Semantics (PTX ``shfl.sync`` / ``vote.sync`` / ``match.sync`` as numba-cuda
emits them; the clamp values are numba's: 0 for ``up``, 0x1f otherwise):

* a warp is 32 consecutive threads of the block (by linear thread id); the last
  warp of a block may be partial;
* every lane named in ``mask`` meets at the operation (a per-warp rendezvous,
  like the simulator's ``syncthreads`` but among the named lanes only) before
  any of them gets a result; lanes not named do not take part;
* the source lane is ``laneid + delta`` (down), ``laneid - delta`` (up),
  ``laneid ^ lane_mask`` (xor), ``src_lane`` (idx), each with only the low 5
  bits of the operand, as the hardware reads it; an ``up``/``down`` source
  outside the warp returns the caller's own value;
* a source lane inside the warp but not named in the mask is undefined on
  hardware: here it returns NaN (floats) or 0xDEADBEEF (integers), so that a
  result depending on it shows;
* only 32/64-bit ints and floats shuffle (numba-cuda refuses others at typing).

What hangs or is undefined on hardware raises here instead: a caller not named
in its own mask; a mask naming a lane that does not exist (past the end of a
partial warp) or has exited; lanes of one mask meeting at different kinds of
operation, or waiting on each other under different masks; a lane named in the
mask that sits in ``syncthreads`` instead (divergence).  The error reaches the
launching thread like any other exception in a simulated kernel.

``activemask()`` returns the warp's lanes that exist and have not exited: the
simulator does not track which lanes run a branch together (hardware returns the
converged subset), so in divergent code it may name more lanes than hardware.
"""

import functools
import threading

import numpy as np

WARP = 32
_FULL = 0xFFFFFFFF
_POLL = 0.02  # seconds between a waiting lane's checks for a deadlock
# what a lane not named in the mask "returns" (undefined on hardware)
_POISON_INT = 0xDEADBEEF

_registry_lock = threading.Lock()


class WarpError(RuntimeError):
    """A warp operation that would hang or be undefined on hardware."""


# ---------------------------------------------------------------- per-warp state

class _Op:
    """One warp operation in progress: the lanes of ``mask`` meeting at ``kind``."""

    __slots__ = ("kind", "mask", "args", "results", "done")

    def __init__(self, kind, mask):
        self.kind = kind
        self.mask = mask
        self.args = {}       # lane -> (value, operand)
        self.results = None  # lane -> result, once every lane has arrived
        self.done = False


class _Warp:
    def __init__(self):
        self.cond = threading.Condition()
        self.pending = {}    # mask -> _Op: at most one operation in flight per mask


def _threads(manager):
    """A simulated block's threads by linear id (recorded as the simulator creates them)."""
    return manager.__dict__.get("_nn_threads", {})


def _warp(manager, w):
    warps = manager.__dict__.get("_nn_warps")
    if warps is None:
        with _registry_lock:
            warps = manager.__dict__.setdefault("_nn_warps", {})
    wp = warps.get(w)
    if wp is None:
        with _registry_lock:
            wp = warps.setdefault(w, _Warp())
    return wp


def _block_size(manager):
    n = 1
    for d in manager._block_dim:
        n *= d
    return n


def _lanes(mask):
    return [i for i in range(WARP) if mask >> i & 1]


# ---------------------------------------------------------------- the rendezvous

def _check_mask(me, mask, what):
    """The caller's (thread, warp index, lane) after checking ``mask`` against its warp."""
    tid = me.thread_id
    lane = tid % WARP
    if not mask >> lane & 1:
        raise WarpError(f"{what}: lane {lane} is not named in its own mask {mask:#010x} "
                        "(undefined on hardware)")
    first = tid - lane
    exist = min(WARP, _block_size(me._manager) - first)
    missing = mask >> exist
    if missing:
        raise WarpError(f"{what}: mask {mask:#010x} names lane(s) {[exist + i for i in _lanes(missing)]} "
                        f"that do not exist (the warp has {exist} lanes): a hang on hardware")
    return tid // WARP, lane


def _stuck(me, op, lane, first):
    """Why lane ``lane`` of the caller's warp can never reach ``op``, or None."""
    t = _threads(me._manager).get(first + lane)
    if t is None or not t._started.is_set():
        return None  # not started yet: the simulator starts a block's threads one by one
    if not t.is_alive():
        if t.exception:  # it raised (at a warp operation of its own, say): that is the cause
            return f"lane {lane} raised instead: {t.exception[0]}"
        return f"lane {lane} exited without reaching it"
    other = getattr(t, "_nn_waiting", None)
    if other is not None and other is not op and not other.done and other.mask >> (me.thread_id % WARP) & 1:
        return (f"lane {lane} waits at {other.kind} with mask {other.mask:#010x} instead: "
                "mismatched warp operations")
    # at a block barrier the caller has not reached (a lane still flagged at one
    # the caller has passed is being released by the simulator right now)
    if t.syncthreads_blocked and getattr(t, "_nn_barriers", 0) > getattr(me, "_nn_barriers", 0):
        return f"lane {lane} waits at syncthreads instead: divergent code"
    return None


def _meet(kind, mask, value, operand, compute):
    """Rendezvous of the lanes of ``mask``; ``compute(args) -> {lane: result}`` runs once."""
    me = threading.current_thread()
    if getattr(me, "_manager", None) is None:
        raise WarpError(f"{kind} called outside a simulated kernel")
    mask = int(mask) & _FULL
    w, lane = _check_mask(me, mask, kind)
    warp = _warp(me._manager, w)
    first = w * WARP
    with warp.cond:
        op = warp.pending.get(mask)
        if op is None:
            op = warp.pending[mask] = _Op(kind, mask)
        elif op.kind != kind:
            raise WarpError(f"{kind}: lane {lane} meets lanes {sorted(op.args)} that are at {op.kind} "
                            f"with the same mask {mask:#010x}: mismatched warp operations")
        op.args[lane] = (value, operand)
        if len(op.args) == bin(mask).count("1"):
            op.results = compute(op.args)
            op.done = True
            del warp.pending[mask]
            warp.cond.notify_all()
        else:
            me._nn_waiting = op
            try:
                while not op.done:
                    warp.cond.wait(_POLL)
                    if op.done:
                        break
                    if me.abort:
                        raise RuntimeError(f"abort flag set in {kind}")
                    for other in _lanes(mask):
                        if other not in op.args:
                            why = _stuck(me, op, other, first)
                            if why:
                                raise WarpError(f"{kind} with mask {mask:#010x} in warp {w} "
                                                f"(lane {lane} waiting): {why} -- a hang on hardware")
            finally:
                me._nn_waiting = None
        return op.results[lane]


# ---------------------------------------------------------------- the operations

_SHUFFLE_TYPES = (int, float, np.int32, np.int64, np.float32, np.float64)


def _shuffle_value(kind, value):
    # bool is an int subclass; numba types it b1, which shfl refuses
    if type(value) not in _SHUFFLE_TYPES:
        raise TypeError(f"{kind} only supports 32- and 64-bit ints and floats, got "
                        f"{type(value).__name__}")
    return value


def _poison(value):
    if isinstance(value, (float, np.floating)):
        return type(value)(np.nan)
    if type(value) is np.int32:
        return np.uint32(_POISON_INT).view(np.int32)
    return type(value)(_POISON_INT)


def _shuffle(kind, mask, value, operand, source):
    """``source(lane, b) -> (source lane, in range)`` as in PTX, with b = operand[4:0]."""
    _shuffle_value(kind, value)

    def compute(args):
        out = {}
        for lane, (v, b) in args.items():
            src, ok = source(lane, int(b) & 31)
            if not ok:
                out[lane] = v                    # out of range: the caller's own value
            elif src in args:
                out[lane] = args[src][0]
            else:
                out[lane] = _poison(v)           # not in the mask: undefined
        return out

    return _meet(kind, mask, value, operand, compute)


def shfl_sync(self, mask, value, src_lane):
    return _shuffle("shfl_sync", mask, value, src_lane, lambda lane, b: (b, True))


def shfl_up_sync(self, mask, value, delta):
    return _shuffle("shfl_up_sync", mask, value, delta, lambda lane, b: (lane - b, lane - b >= 0))


def shfl_down_sync(self, mask, value, delta):
    return _shuffle("shfl_down_sync", mask, value, delta, lambda lane, b: (lane + b, lane + b <= 31))


def shfl_xor_sync(self, mask, value, lane_mask):
    return _shuffle("shfl_xor_sync", mask, value, lane_mask, lambda lane, b: (lane ^ b, True))


def syncwarp(self, mask=_FULL):
    _meet("syncwarp", mask, None, None, lambda args: dict.fromkeys(args))


def _ballot(args):
    bits = 0
    for lane, (p, _) in args.items():
        if p:
            bits |= 1 << lane
    return bits


def _as_int32(bits):
    return int(np.uint32(bits).view(np.int32))


def all_sync(self, mask, predicate):
    return _meet("all_sync", mask, bool(predicate), None,
                 lambda args: dict.fromkeys(args, all(p for p, _ in args.values())))


def any_sync(self, mask, predicate):
    return _meet("any_sync", mask, bool(predicate), None,
                 lambda args: dict.fromkeys(args, any(p for p, _ in args.values())))


def eq_sync(self, mask, predicate):
    return _meet("eq_sync", mask, bool(predicate), None,
                 lambda args: dict.fromkeys(args, len({p for p, _ in args.values()}) == 1))


def ballot_sync(self, mask, predicate):
    # numba-cuda types the ballot as int32
    return _meet("ballot_sync", mask, bool(predicate), None, lambda args: dict.fromkeys(args, _as_int32(_ballot(args))))


def match_any_sync(self, mask, value):
    def compute(args):
        return {lane: sum(1 << o for o, (u, _) in args.items() if u == v) for lane, (v, _) in args.items()}

    return _meet("match_any_sync", mask, value, None, compute)


def match_all_sync(self, mask, value):
    def compute(args):
        same = len({v for v, _ in args.values()}) == 1
        return dict.fromkeys(args, (int(mask) & _FULL if same else 0, same))

    return _meet("match_all_sync", mask, value, None, compute)


def activemask(self):
    me = threading.current_thread()
    tid = me.thread_id
    first = tid - tid % WARP
    threads = _threads(me._manager)
    bits = 0
    for lane in range(min(WARP, _block_size(me._manager) - first)):
        t = threads.get(first + lane)
        if t is None or not t._started.is_set() or t.is_alive():
            bits |= 1 << lane
    return bits


def lanemask_lt(self):
    return (1 << (threading.current_thread().thread_id % WARP)) - 1


_OPS = {f.__name__: f for f in (shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, syncwarp,
                                activemask, lanemask_lt, all_sync, any_sync, eq_sync, ballot_sync,
                                match_any_sync, match_all_sync)}


# ---------------------------------------------------------------- installing

def _track_threads(kernel_mod):
    """Make each simulated block remember its threads by id, and each thread count
    the block barriers it has entered (the rendezvous needs to see whether a
    missing lane has exited or waits at a barrier the caller has not reached)."""
    cls = kernel_mod.BlockThread
    if getattr(cls, "_nn_tracked", False):
        return
    init, sync = cls.__init__, cls.syncthreads

    def __init__(self, f, manager, *args, **kwargs):
        init(self, f, manager, *args, **kwargs)
        self._nn_barriers = 0
        manager.__dict__.setdefault("_nn_threads", {})[self.thread_id] = self

    @functools.wraps(sync)
    def syncthreads(self):
        self._nn_barriers += 1
        sync(self)

    cls.__init__ = __init__
    cls.syncthreads = syncthreads
    cls._nn_tracked = True


def install():
    """Add the warp intrinsics to numba's simulator; returns the names added.

    A no-op (returns ()) when the simulator is off; never replaces an
    intrinsic the simulator already provides.
    """
    from numba import cuda

    if not cuda.config.ENABLE_CUDASIM:
        return ()
    from numba.cuda.simulator import kernel, kernelapi

    _track_threads(kernel)
    added = []
    for name, fn in _OPS.items():
        if not hasattr(kernelapi.FakeCUDAModule, name):
            setattr(kernelapi.FakeCUDAModule, name, fn)
            added.append(name)
    return tuple(added)
