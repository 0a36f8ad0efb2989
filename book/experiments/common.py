"""What the book's experiment scripts share: one thread, arguments, results JSON.

Each script in this folder trains a few small networks and writes what the
chapters plot to ``book/results/<name>.json``.  The chapters never train these
networks while the book builds: they load the committed JSON.
"""

import os

# one thread everywhere, set before numpy, numba and torch start their pools:
# the networks are tiny and the machines that rerun this are shared
for _var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
             "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "results")


def parse_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long smoke run (what the tests run), "
                        "not the book's results")
    p.add_argument("--out", default=RESULTS,
                   help="folder for the JSON (default: book/results)")
    return p.parse_args()


def versions():
    import numba
    import numbanorm
    v = {"python": platform.python_version(), "numpy": np.__version__,
         "numba": numba.__version__, "numbanorm": numbanorm.__version__}
    if "torch" in sys.modules:
        v["torch"] = sys.modules["torch"].__version__
    return v


def write(out, name, quick, settings, results, started):
    """Write ``<out>/<name>.json``: the settings, versions and results."""
    os.makedirs(out, exist_ok=True)
    doc = {"experiment": name, "quick": quick,
           "created": datetime.datetime.now(datetime.timezone.utc)
           .strftime("%Y-%m-%d %H:%M UTC"),
           "seconds": round(time.perf_counter() - started, 1),
           # on a shared machine the wall time says more about the neighbours
           "cpu_seconds": round(time.process_time(), 1),
           "command": "python book/experiments/" + name + ".py",
           "versions": versions(), "settings": settings, "results": results}
    path = os.path.join(out, name + ".json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({doc['seconds']:.0f}s, {doc['cpu_seconds']:.0f}s CPU)")
    return path
