"""The installed package: read-only installs, and the on-disk cache of compiled kernels.

Each case runs a copy of the package in a fresh interpreter, the way an install
is used: a read-only copy (as an unprivileged user when the tests run as root,
for whom file modes mean nothing) must import and compute without a writable
cache directory, and a kernel's on-disk cache must not outlive an edit of any
source it compiles.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import numbanorm

pytestmark = pytest.mark.slow  # (the default test set leaves this file out: tests/README.md)

PACKAGE = os.path.dirname(os.path.abspath(numbanorm.__file__))
NOBODY = 65534

# every family, forward and backward, against the float64 oracle
_CHECK = """
import numpy as np
import numbanorm as nn
from numbanorm import reference as ref

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 8))
r = rng.standard_normal((4, 8))
w = rng.standard_normal(8)
y, mean, rstd = nn.layer_norm_forward(x, 8, w, w)
assert np.allclose(y, ref.layer_norm(x, 8, w, w), rtol=1e-11, atol=1e-12)
dx, dw, db = nn.layer_norm_backward(y, x, mean, rstd, 8, w)
assert np.allclose(dx, ref.layer_norm_backward(y, x, mean, rstd, 8, w)[0], rtol=1e-11, atol=1e-10)
assert np.allclose(nn.rms_norm(x, 8, w), ref.rms_norm(x, 8, w), rtol=1e-11, atol=1e-12)
assert np.allclose(nn.group_norm(x.reshape(2, 4, 4), 2), ref.group_norm(x.reshape(2, 4, 4), 2), rtol=1e-11, atol=1e-12)
assert np.allclose(nn.add_layer_norm(x, r, 8)[0], ref.layer_norm(x + r, 8), rtol=1e-11, atol=1e-12)
print("ok")
"""


def _copy_package(dst):
    target = os.path.join(dst, "numbanorm")
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("NUMBA_CACHE") and k not in ("XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(extra)
    return env


def _run(code, env, **kwargs):
    # cwd "/": `python -c` puts the working directory first on sys.path
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd="/",
                          capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc.stdout


def _make_read_only(path):
    """No cache directory can be made under ``path``, even by root (for whom
    file modes mean nothing): every ``__pycache__`` and ``.cache`` is a file."""
    for root, dirs, files in os.walk(path):
        if "__init__.py" in files or root == path:
            for blocked in ("__pycache__", ".cache"):
                with open(os.path.join(root, blocked), "w"):
                    pass
    for root, dirs, files in os.walk(path):
        for name in files:
            os.chmod(os.path.join(root, name), 0o444)
        os.chmod(root, 0o555)


def _unprivileged():
    """``preexec_fn`` running the child as nobody, when root can do that and
    nobody can run this interpreter; else None."""
    if os.geteuid() != 0:
        return None

    def drop():
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    try:
        ok = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=drop).returncode == 0
    except OSError:  # e.g. the interpreter lives under root's home
        ok = False
    return drop if ok else None


def test_read_only_install_imports_and_computes(tmp_path):
    site = tmp_path / "site"
    home = tmp_path / "home"
    site.mkdir()
    home.mkdir()
    pkg = _copy_package(str(site))
    _make_read_only(str(site))
    _make_read_only(str(home))
    os.chmod(tmp_path, 0o755)
    env = _env(PYTHONPATH=str(site), HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    code = "import numbanorm; assert numbanorm.__file__.startswith(%r), numbanorm.__file__\n" % pkg
    assert _run(code + _CHECK, env, preexec_fn=_unprivileged()).strip().endswith("ok")
    assert not any(os.path.isdir(os.path.join(r, "__pycache__")) for r, _, _ in os.walk(pkg))


def test_editing_a_helper_in_another_file_invalidates_the_cache(tmp_path):
    pkg = _copy_package(str(tmp_path))
    env = _env(PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    # add_layer_norm's row function lives in add_norm.py and inlines spans.normalize_span
    code = """
        import numpy as np
        import numbanorm
        from numbanorm.cpu._kernels import add_norm
        assert numbanorm.__file__.startswith(%r)
        x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
        y = numbanorm.add_layer_norm(x, x, 8)[0]
        hits = sum(add_norm._layer_norm_forward.rows.stats.cache_hits.values())
        print(repr(y.tolist()), hits)
    """ % pkg
    y0, hits0 = _run(code, env).rsplit(" ", 1)
    y1, hits1 = _run(code, env).rsplit(" ", 1)
    assert (y1, int(hits0), int(hits1)) == (y0, 0, 1)  # the second run loaded the cache

    helper = os.path.join(pkg, "cpu", "_kernels", "spans.py")
    with open(helper) as f:
        src = f.read()
    # normalize_span's plain store (the first after its def): every output plus 1
    at = src.index("out[o, j] = narrow(v, out)\n", src.index("def normalize_span("))
    with open(helper, "w") as f:
        f.write(src[:at] + src[at:].replace("narrow(v, out)", "narrow(v + 1, out)", 1))
    y2, hits2 = _run(code, env).rsplit(" ", 1)
    assert int(hits2) == 0
    import numpy as np
    # the edited helper's +1, in float32
    np.testing.assert_allclose(np.array(eval(y2)), np.array(eval(y0)) + 1, rtol=0, atol=1e-6)
