"""``python -m numbanorm``: check every kernel on this machine against the oracle."""

import sys

import numpy as np


def check():
    from . import registry

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 768)).astype(np.float32)
    x4 = rng.standard_normal((4, 32, 8, 8)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 768).astype(np.float32)
    oracle = registry.get("oracle")
    ok = True
    print(f"{'implementation':<14} {'function':<20} {'max |error|':>12}  result")
    for name in registry.available(include_oracle=False):
        impl = registry.get(name)
        for fn, args in [("layer_norm", (x, 768, w)), ("rms_norm", (x, 768, w)), ("group_norm", (x4, 8))]:
            got = np.asarray(getattr(impl, fn)(*args), dtype=np.float64)
            err = float(np.max(np.abs(got - getattr(oracle, fn)(*args))))
            passed = err < 1e-4
            ok &= passed
            print(f"{name:<14} {fn:<20} {err:12.2e}  {'pass' if passed else 'FAIL'}")
    return 0 if ok else 1


def main(argv=None):
    return check()


if __name__ == "__main__":
    sys.exit(main())
