"""GB/s against the size of x, the copy floor as a line: one PNG per norm and direction.

    python -m benchmarks.plot benchmarks/results/cpu.json

writes ``benchmarks/results/<stem>-<norm>-<direction>.png`` (the book includes
them).  Rows of subplots are dtypes; layer/RMS norm get a column per hidden size.
GB/s counts the bytes a kernel must move (forward x + y, backward x + dy + dx);
the floor line is the bandwidth of ``np.copyto`` on the same machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from . import measure  # noqa: E402

from .harness import RESULTS, load_results  # noqa: E402

STYLE = {  # (impl, mode) -> matplotlib keyword arguments
    ("numbanorm.cpu", "out"): dict(color="C0", marker="o", label="numbanorm (out=)"),
    ("numbanorm.cpu", "alloc"): dict(color="C0", marker="o", ls=":", label="numbanorm"),
    ("numbanorm.cuda", "out"): dict(color="C0", marker="o", label="numbanorm (out=)"),
    ("numbanorm.cuda", "alloc"): dict(color="C0", marker="o", ls=":", label="numbanorm"),
    ("torch", "alloc"): dict(color="C1", marker="s", label="torch.nn.functional"),
    ("oracle", "alloc"): dict(color="C2", marker="^", label="NumPy oracle"),
    ("floor", "out"): dict(color="black", ls="--", label="copy floor"),
}


def plot_results(results, stem, folder=RESULTS):
    """Write the PNGs for every (device, norm, direction) in ``results``; returns their paths."""
    rows = results["rows"]
    meta = results.get("meta", {})
    paths = []
    groups = sorted({(r["device"], r["norm"], r["direction"]) for r in rows})
    for device, norm, direction in groups:
        sel = [r for r in rows if (r["device"], r["norm"], r["direction"]) == (device, norm, direction)]
        dtypes = sorted({r["dtype"] for r in sel}, key=lambda d: (len(d), d))
        per_hidden = measure.layout_of(norm) == "rows"
        cols = sorted({r["shape"][-1] for r in sel}) if per_hidden else [None]
        fig, axes = plt.subplots(len(dtypes), len(cols), figsize=(3.6 * len(cols) + 1, 3.0 * len(dtypes) + 0.6),
                                 squeeze=False, sharey="row")
        for i, dt in enumerate(dtypes):
            for j, hid in enumerate(cols):
                ax = axes[i][j]
                cell = [r for r in sel if r["dtype"] == dt and (hid is None or r["shape"][-1] == hid)]
                for key, style in STYLE.items():
                    pts = sorted((r["elements"], r["gbps"]) for r in cell if (r["impl"], r["mode"]) == key
                                 and r["gbps"] is not None)
                    if not pts:
                        continue
                    nbytes = _itemsize(dt)
                    ax.plot([e * nbytes / 2**20 for e, _ in pts], [g for _, g in pts], ms=4, **style)
                ax.set_xscale("log", base=2)
                ax.grid(True, which="both", alpha=0.3)
                title = f"{dt}" + (f", hidden {hid}" if hid else "")
                ax.set_title(title, fontsize=9)
                if i == len(dtypes) - 1:
                    ax.set_xlabel("size of x (MiB)")
                if j == 0:
                    ax.set_ylabel("GB/s")
        handles, labels = axes[0][0].get_legend_handles_labels()
        for ax in axes.flat:  # collect every series drawn anywhere
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
        m = meta.get("machine", {})
        fig.suptitle(f"{norm} {direction} on {device}: {m.get('cpu') if device == 'cpu' else m.get('gpu')}, "
                     f"{meta.get('threads')} thread(s), {meta.get('date', '')[:10]}", fontsize=10)
        fig.tight_layout(rect=(0, 0.06, 1, 0.97))
        path = Path(folder) / f"{stem}-{norm}-{direction}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _itemsize(dtype):
    from numbanorm.measure import ITEMSIZE

    return ITEMSIZE[dtype]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a results JSON file")
    a = ap.parse_args(argv)
    for p in plot_results(load_results(a.results), Path(a.results).stem, Path(a.results).parent):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
