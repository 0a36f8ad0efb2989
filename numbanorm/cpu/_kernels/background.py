"""The parallel kernels are compiled on a thread of their own: no call waits for one.

A parallel kernel is a loop over row blocks around a row function (``common.in_blocks``),
and the calling thread can run the same row function over all the blocks itself
(``common.launch``), with the same bits.  So a call whose parallel kernel is neither
compiled nor in the on-disk cache runs on the calling thread, and the kernel is
compiled meanwhile by :func:`compile_later`'s worker thread; the calls after it run on
Numba's threads.  Compiling a parallel kernel costs more than compiling its row
function (Numba's parfors pipeline optimizes and generates the row function's code
again in each of the four modules it makes), so a first call waits for the row
function alone.  The row functions' streaming-store variants (``common.STREAMING``),
row function and parallel kernel, are compiled here too, the plain ones standing in,
and so is the launchers' loop that widens float16 weights (NumPy's cast standing in).
A compile asked for during a launch starts when the launch returns
(:func:`compile_after_launch`): started at once, it would share the interpreter with
the row function's compile that the call waits for.

The worker holds Numba's compiler lock while it compiles, and a child forked then
would inherit the lock held by a thread it does not have, and hang at its first
compile: a fork waits for the job in progress to end (:func:`_before_fork`).  The
worker is not a daemon, so a process that exits right after its first call still
writes its kernels to the cache.
"""

import contextlib
import os
import queue
import threading

from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import CPUDispatcher

# False: a miss compiles on the calling thread, as Numba does (the compile command's mode)
ENABLED = os.environ.get("NUMBANORM_COMPILE_IN_BACKGROUND", "1") != "0"


class NotCompiled(Exception):
    """A parallel kernel that is neither compiled nor cached for a call's types."""

    def __init__(self, dispatcher, sig):
        super().__init__(f"{dispatcher.py_func.__qualname__}{sig}: not compiled yet")
        self.dispatcher, self.sig = dispatcher, sig


class Dispatcher(CPUDispatcher):
    """Numba's dispatcher of a ``parallel=True`` kernel, except that a call of types it has
    neither compiled nor cached raises :class:`NotCompiled` instead of compiling
    (``common.launch`` then runs the row function on the calling thread and hands the
    compile to :func:`compile_later`).  A hit costs what Numba's costs: only a miss
    comes here."""

    def _compile_for_args(self, *args, **kws):
        if ENABLED and not getattr(_local, "synchronous", False):
            sig = tuple(self.typeof_pyval(a) for a in args)
            holds = getattr(self._cache, "holds", None)
            if (sig not in self.overloads and (self, sig) not in _failed  # (a failure raises here)
                    and not (holds and holds(sig, self.targetctx))):
                raise NotCompiled(self, sig)
        return super()._compile_for_args(*args, **kws)  # loads it from the cache, or compiles it


_local = threading.local()
_jobs = queue.Queue()
_queued = set()        # (dispatcher, sig) queued or compiling
_state = threading.Lock()  # guards _queued and _worker
_worker = None
# held by the worker while it compiles; a fork takes it first (_before_fork)
_job_lock = threading.Lock()
_failed = {}           # (dispatcher, sig) -> the exception its compile raised


def compile_later(dispatcher, sig):
    """Compile ``dispatcher`` for the argument types ``sig`` on the worker thread (once)."""
    global _worker
    with _state:
        key = (dispatcher, sig)
        if key in _queued or key in _failed:
            return
        _queued.add(key)
        _jobs.put(key)
        if _worker is None:
            _worker = threading.Thread(target=_work, name="numbanorm-compile", daemon=False)
            _worker.start()


waiting = 0  # compiles kept by compile_after_launch, on every thread: launch reads it alone


def compile_after_launch(dispatcher, sig):
    """:func:`compile_later`, once the calling thread's launch (``common.launch``) returns: a
    compile started at once would share the interpreter with the call's own compile of its
    row function, which the first call waits for."""
    global waiting
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = []
    with _state:
        if (dispatcher, sig) not in pending:  # (a call outside a launch may ask again and again)
            pending.append((dispatcher, sig))
            waiting += 1


def launched():
    """Hand what :func:`compile_after_launch` kept on this thread to :func:`compile_later`
    (``common.launch`` calls it last, where ``waiting``)."""
    global waiting
    pending = getattr(_local, "pending", None)
    if pending:
        with _state:
            _local.pending = []
            waiting -= len(pending)
        for dispatcher, sig in pending:
            compile_later(dispatcher, sig)


@contextlib.contextmanager
def synchronous():
    """Within this block the calling thread compiles what it calls, as Numba does."""
    was = getattr(_local, "synchronous", False)
    _local.synchronous = True
    try:
        yield
    finally:
        _local.synchronous = was


def _work():
    global _worker
    _local.synchronous = True
    while True:
        with _state:
            try:
                key = _jobs.get_nowait()
            except queue.Empty:
                _worker = None
                return
        with _job_lock:
            try:
                key[0].compile(key[1])
            except Exception as e:  # a call that needs it compiles it again and raises it there
                _failed[key] = e
            finally:
                with _state:
                    _queued.discard(key)
                _jobs.task_done()


def wait():
    """Return when every kernel handed to :func:`compile_later` (or kept on this thread by
    :func:`compile_after_launch`) is compiled."""
    launched()
    _jobs.join()


def _before_fork():
    # the compile thread's compile, then any other thread's (a caller's first call): a child
    # would inherit Numba's compiler lock held by a thread it does not have, and hang on it
    _job_lock.acquire()
    global_compiler_lock.acquire()


def _after_fork_in_parent():
    global_compiler_lock.release()
    _job_lock.release()


def _after_fork_in_child():
    global _jobs, _queued, _state, _worker, _job_lock, waiting
    global_compiler_lock.release()  # (held by this thread, the one that forked)
    # the worker is not copied: the jobs left are the child's to compile when it calls them
    _jobs, _queued, _state, _worker, _job_lock = queue.Queue(), set(), threading.Lock(), None, threading.Lock()
    _local.synchronous = False
    _local.pending, waiting = [], 0  # (the forking thread's: the others are not copied)


if hasattr(os, "register_at_fork"):  # (where fork exists: not on Windows)
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
