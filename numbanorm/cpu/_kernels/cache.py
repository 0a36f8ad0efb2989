"""The on-disk cache of the CPU kernels: keyed on all their source, optional.

Numba's own ``cache=True`` has two faults for a package laid out like this one:

* It stamps a cached kernel with the hash of the one file that holds the
  decorated function.  The helpers it inlines (``row_sums``, ``normalize_span``,
  ``stream_row`` ...) live in other files, so editing one of them left a kernel
  of another file loading its old machine code.  Here the stamp is one hash of
  every ``.py`` file of this package (the kernels compile nothing from outside
  it but NumPy and Numba, whose versions Numba's index already checks).
* It finds the cache directory from the function's source file, so a function
  compiled from generated source (``common.in_blocks``'s kernels) could not be cached
  under a file name of its own.  Here :data:`GENERATED` maps such a name to the
  file whose source generated it.
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
from numba.core.runtime import rtsys

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


# the file name a generated function was compiled under -> the source file it belongs to
GENERATED = {}


class _PackageStamped:
    """A locator mixin: the source stamp is the whole package's, not one file's, and a
    generated function is located by the file it was generated from."""

    def get_source_stamp(self):
        return package_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        return super().from_function(py_func, GENERATED.get(py_file, py_file))


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

    def holds(self, sig, target_context):
        """Whether the cache has an entry for the argument types ``sig`` (read from its index,
        nothing loaded).  Without Numba's compiler lock, so nothing that a compile on another
        thread reads is touched (``target_context.refresh()`` here made a concurrent typing
        miss the attributes of arrays)."""
        if not self._enabled:
            return False
        return self._index_key(sig, target_context.codegen()) in self._cache_file._load_index()

    def load_overload(self, sig, target_context):
        """Numba's, without its ``target_context.refresh()`` first: that registers every
        lowering of Python and NumPy, which a compile needs (and a compile refreshes the
        context itself) but a loaded kernel, machine code, does not; of it the kernel needs
        Numba's runtime (NRT: allocation), started here.  Where that finds nothing, Numba's
        own load (refresh included) looks again: an index key hashes the kernel's closure,
        which a refresh could change."""
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            got = self._load_overload(sig, target_context)
        return got if got is not None else super().load_overload(sig, target_context)


def njit(*args, cache=False, dispatcher=None, **options):
    """``numba.njit`` with NumPy's error model; ``cache=True`` caches on disk with :class:`KernelCache`
    where some directory is writable, and compiles in memory where none is.  ``dispatcher``:
    a subclass of Numba's CPU dispatcher to make instead of its own."""
    if args and callable(args[0]):
        return njit(cache=cache, dispatcher=dispatcher, **options)(args[0])

    # NumPy's error model everywhere, as parallel=True kernels have: a division by zero
    # (eps=0 on a constant row) gives inf/NaN instead of raising from a row function
    options.setdefault("error_model", "numpy")

    def decorate(fn):
        if dispatcher is None or numba.config.DISABLE_JIT:
            made = numba.njit(**options)(fn)
        else:  # as numba.njit makes its own
            made = dispatcher(py_func=fn, locals={}, targetoptions=dict(options, nopython=True, boundscheck=None))
        if cache and not numba.config.DISABLE_JIT:
            try:
                made._cache = KernelCache(made.py_func)
            except RuntimeError:  # "no locator available": no writable directory
                pass
        return made

    return decorate
