"""Whether anything measured got slower: two results files of ``benchmarks.run``, case by case.

    python -m benchmarks.compare benchmarks/results/cpu.json NEW.json [--limit 1.10]

A case is numbanorm's row (one implementation, mode, direction, dtype, shape) present in
both files.  Two runs on a shared machine differ by the machine's state as much as by the
code, so a case counts as slower only when both of these grew past ``--limit``:

* its time over the copy floor measured in the same run (``x_floor``): the machine's
  memory speed cancels out, and
* its median time, with the new run's 20 % quantile above the old run's 80 % quantile:
  the two runs' spreads do not overlap.

Prints every case that got slower and a summary; exits 1 if any did.
"""

from __future__ import annotations

import argparse
import sys

from . import harness

IMPLS = ("numbanorm.cpu", "numbanorm.torch", "numbanorm.cuda")


def key(row):
    return (row["impl"], row["mode"], row["threads"]) + harness.case_key(row)


def compare(old_rows, new_rows, limit):
    """``(slower, matched)``: the slower cases as (key, floor ratio, time ratio), and how
    many cases the two files share."""
    old = {key(r): r for r in old_rows if r["impl"] in IMPLS}
    slower, matched = [], 0
    for r in new_rows:
        o = old.get(key(r))
        if o is None:
            continue
        matched += 1
        t = r["median_s"] / o["median_s"]
        f = r["x_floor"] / o["x_floor"] if r.get("x_floor") and o.get("x_floor") else t
        apart = r["q20_s"] > o["q80_s"]
        if f > limit and t > limit and apart:
            slower.append((key(r), f, t))
    return slower, matched


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--limit", type=float, default=1.10, help="ratio new/old counted as slower (default 1.10)")
    a = ap.parse_args(argv)
    old, new = harness.load_results(a.old), harness.load_results(a.new)
    slower, matched = compare(old["rows"], new["rows"], a.limit)
    for (impl, mode, _, norm, direction, shape, dtype, groups, _), f, t in sorted(slower, key=lambda s: -s[1]):
        label = f"{norm} {direction} {mode} {dtype} {'x'.join(map(str, shape))}" + (f" g{groups}" if groups else "")
        print(f"SLOWER {impl:14s} {label:48s} x_floor {f:.2f}x  median {t:.2f}x")
    print(f"{len(slower)} of {matched} shared cases slower than {a.limit:.2f}x "
          f"({old['meta']['date'][:10]} -> {new['meta']['date'][:10]})")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
