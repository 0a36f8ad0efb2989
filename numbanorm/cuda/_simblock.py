"""The simulator's block loop, yielding the GIL between its polls.

numba's CUDA simulator runs a block's threads as Python threads and its
``BlockManager.run`` polls them in a loop, holding the GIL, until every thread
has exited (releasing a ``syncthreads`` when all are blocked at one).  The
threads then get the GIL only when the interpreter's switch interval forces the
poller to drop it, and how long a kernel takes swings with that interval and
the load: a float32 LayerNorm forward and backward of (6, 1024) took 2.2 s at a
switch interval of 1 ms, 3.5 s at the default 5 ms and 23 s at 0.5 ms on the
2-core VM, and single simulator tests that take 3 s alone took 100-290 s in
one full run.  ``install()`` replaces ``run`` with the same loop plus a
``time.sleep(0)`` (which releases the GIL) after each poll: 1.5 s at the
default interval, 2.5 s at 0.5 ms.  The semantics are numba-cuda 0.30's; the
loop is replaced only where ``run`` still has that version's signature.
"""

import inspect
import time

import numpy as np


def _run(self, grid_point, *args):
    """numba-cuda's ``BlockManager.run``, with ``time.sleep(0)`` after each poll."""
    from numba.cuda.simulator.kernel import BlockThread

    threads = set()
    livethreads = set()
    blockedthreads = set()
    for block_point in np.ndindex(*self._block_dim):

        def target():
            self._f(*args)

        t = BlockThread(target, self, grid_point, block_point, self._debug)
        t.start()
        threads.add(t)
        livethreads.add(t)
    while livethreads:
        for t in livethreads:
            if t.syncthreads_blocked:
                blockedthreads.add(t)
            elif t.exception:
                # abort every other thread; do not join (as numba-cuda)
                for t_other in threads:
                    t_other.abort = True
                    t_other.syncthreads_blocked = False
                    t_other.syncthreads_event.set()
                raise t.exception[0].with_traceback(t.exception[1])
        if livethreads == blockedthreads:
            for t in blockedthreads:
                t.syncthreads_blocked = False
                t.syncthreads_event.set()
            blockedthreads = set()
        livethreads = set([t for t in livethreads if t.is_alive()])
        time.sleep(0)  # the GIL to the block's threads: the loop only polls
    for t in threads:
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


def install():
    """Replace the simulator's ``BlockManager.run`` (once; a no-op off the simulator
    or where numba-cuda's ``run`` is not the one copied here)."""
    from numba import cuda

    if not cuda.config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator import kernel

    cls = kernel.BlockManager
    if cls.run is _run:
        return False
    if list(inspect.signature(cls.run).parameters) != ["self", "grid_point", "args"]:
        return False
    cls.run = _run
    return True
