"""The on-disk cache of the CPU kernels: keyed on all their source, optional.

Numba's own ``cache=True`` has two faults for a package laid out like this one:

* It stamps a cached kernel with the hash of the one file that holds the
  decorated function.  The helpers it inlines (``row_sum``, ``normalize_span``,
  ``stream_row`` ...) live in other files, so editing one of them left a kernel
  of another file loading its old machine code.  Here the stamp is one hash of
  every ``.py`` file of this package (the kernels compile nothing from outside
  it but NumPy and Numba, whose versions Numba's index already checks).
* With no writable cache directory (a system-wide install used by another user,
  a read-only container image, ``HOME`` read-only) it raises at decoration, so
  ``import numbanorm`` failed.  Here the kernel then compiles in memory.

:func:`njit` is ``numba.njit`` with this cache in place of Numba's: the kernel
modules import it under numba's name, so a decorator reads as usual.
"""

import functools
import hashlib
import os

import numba
from numba.core import caching

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def _package_stamp(stats):
    h = hashlib.sha256()
    for name, _, _ in stats:
        with open(os.path.join(_PACKAGE_DIR, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def package_stamp():
    """One hash of every source file of this package (re-read when one changes)."""
    stats = []
    for name in sorted(os.listdir(_PACKAGE_DIR)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(_PACKAGE_DIR, name))
            stats.append((name, st.st_mtime_ns, st.st_size))
    return _package_stamp(tuple(stats))


class _PackageStamped:
    """A locator mixin: the source stamp is the whole package's, not one file's."""

    def get_source_stamp(self):
        return package_stamp()


class _UserProvided(_PackageStamped, caching.UserProvidedCacheLocator):
    pass


class _InTree(_PackageStamped, caching.InTreeCacheLocator):
    pass


class _UserWide(_PackageStamped, caching.UserWideCacheLocator):
    pass


class _Impl(caching.CompileResultCacheImpl):
    # Numba's order (NUMBA_CACHE_DIR, __pycache__, the user's cache directory);
    # each locator returns None where it cannot write.
    _locator_classes = [_UserProvided, _InTree, _UserWide]


class KernelCache(caching.FunctionCache):
    _impl_class = _Impl


def njit(*args, cache=False, **options):
    """``numba.njit`` with NumPy's error model; ``cache=True`` caches on disk with :class:`KernelCache`
    where some directory is writable, and compiles in memory where none is."""
    if args and callable(args[0]):
        return njit(cache=cache, **options)(args[0])

    # NumPy's error model everywhere, as parallel=True kernels have: a division by zero
    # (eps=0 on a constant row) gives inf/NaN instead of raising from a row function
    options.setdefault("error_model", "numpy")

    def decorate(fn):
        dispatcher = numba.njit(**options)(fn)
        if cache:
            try:
                dispatcher._cache = KernelCache(dispatcher.py_func)
            except RuntimeError:  # "no locator available": no writable directory
                pass
        return dispatcher

    return decorate
