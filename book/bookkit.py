"""What the book's chapters share: BatchNorm in NumPy and the build stamp.

Chapter 1 shows ``BatchNorm1d`` with ``literalinclude`` and chapter 10 trains
with it, so both read this one definition.  The LayerNorm the book uses is
numbanorm's own; numbanorm ships no BatchNorm, so the book brings this one as
its point of comparison.  (Lines stay under 80 columns: the book shows them.)
"""

import contextlib
import datetime
import os
import platform
import textwrap
import warnings

import numpy as np


class BatchNorm1d:
    """BatchNorm over the batch axis of (B, D) activations, as in torch.

    Training mode normalizes each feature with the statistics of the current
    batch and updates the running averages; eval mode normalizes with the
    running averages.  The backward is LayerNorm's with the axes swapped: the
    same xhat, wdy, c1, c2, averaged over the batch instead of the features.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1,
                 dtype=np.float32):
        self.eps, self.momentum = eps, momentum
        self.weight = np.ones(num_features, dtype)      # gamma, per feature
        self.bias = np.zeros(num_features, dtype)       # beta, per feature
        self.running_mean = np.zeros(num_features, dtype)
        self.running_var = np.ones(num_features, dtype)
        self.training = True
        self.grad_weight = self.grad_bias = None
        self._saved = None

    def __call__(self, x):
        if self.training:
            B = x.shape[0]
            if B < 2:  # torch raises too: one value per feature, no spread
                raise ValueError("BatchNorm1d in training needs a batch "
                                 f"of 2 or more, got {B}")
            mean = x.mean(axis=0)
            var = ((x - mean) ** 2).mean(axis=0)   # biased: normalizes
            # the running variance is the unbiased estimate, as in torch
            m = self.momentum
            self.running_mean = ((1 - m) * self.running_mean
                                 + m * mean).astype(x.dtype)
            self.running_var = ((1 - m) * self.running_var
                                + m * var * (B / (B - 1))).astype(x.dtype)
        else:
            mean, var = self.running_mean, self.running_var
        rstd = (1 / np.sqrt(var + self.eps)).astype(x.dtype)
        xhat = (x - mean) * rstd
        self._saved = (xhat, rstd, self.training)
        return xhat * self.weight + self.bias

    def backward(self, dy):
        if self._saved is None:
            raise RuntimeError("BatchNorm1d.backward called before a forward")
        xhat, rstd, training = self._saved
        self.grad_weight = (dy * xhat).sum(axis=0)
        self.grad_bias = dy.sum(axis=0)
        wdy = dy * self.weight
        if not training:  # eval mode is a fixed affine map
            return wdy * rstd
        c1 = (xhat * wdy).mean(axis=0)
        c2 = wdy.mean(axis=0)
        return (wdy - (xhat * c1 + c2)) * rstd


def stamp():
    """When, where and with what a chapter was executed (78 columns)."""
    import numba
    import numbanorm

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    now = datetime.datetime.now(datetime.timezone.utc)
    return textwrap.fill(
        f"Executed {now:%Y-%m-%d %H:%M} UTC on {cpu} "
        f"({os.cpu_count()} logical CPUs, {numba.get_num_threads()} "
        f"Numba threads), {platform.system()}, "
        f"Python {platform.python_version()}, "
        f"numbanorm {numbanorm.__version__}, numba {numba.__version__}, "
        f"numpy {np.__version__}.", width=78)


def print_wrapped(text, width=88):
    """Print ``text`` with its long lines wrapped at ``width`` columns, continuation
    lines indented: a results file's metadata or a long message in one line would make
    the cell's output scroll sideways (book/check_offline.py fails on that)."""
    for line in str(text).split("\n"):
        print(textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False,
                            break_on_hyphens=False) if line.strip() else line)


def readme_tables():
    """The repository's ``benchmarks.readme_table``: chapters 9 and 12 show the
    fused-add and Dask tables with the README's own row builders."""
    return repo_module("benchmarks.readme_table")


def repo_module(name):
    """A module of the repository around the book (``benchmarks.roofline``), importable
    from a chapter's working directory.  The repository goes at the end of the path, so
    that an installed numbanorm (CI builds the book against the wheel) is not shadowed
    by the checkout's."""
    import importlib
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.append(root)
    return importlib.import_module(name)


def print_table(header, rows, text_cols=2):
    """A plain-text table: the first ``text_cols`` columns left-aligned, the
    rest right (as the README's markdown tables align them)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for cells in (header, *rows):
        print("  ".join(str(c).ljust(w) if i < text_cols else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(cells, widths))))


def show_table(header, rows, text_cols=2):
    """The same table as an HTML table: it wraps to the page's width where a printed one
    would scroll.  HTML, not markdown: myst-nb renders a markdown output as CommonMark,
    which has no tables (the pipes came out as one paragraph of text)."""
    from html import escape

    from IPython.display import HTML, display

    def cell(c):  # a line may break after '/' and '_' ("instr/warp/row", "layer_norm_...")
        return escape(str(c)).replace("/", "/<wbr>").replace("_", "_<wbr>")

    def row(cells, tag):
        return "<tr>" + "".join(
            f'<{tag} style="text-align: {"left" if i < text_cols else "right"}; '
            f'padding: 0.15em 0.45em">{cell(c)}</{tag}>'
            for i, c in enumerate(cells)
        ) + "</tr>"

    body = "".join(row(r, "td") for r in rows)
    display(HTML(f'<table class="table" style="font-size: 12px">'
                 f'<thead>{row(header, "th")}</thead><tbody>{body}</tbody></table>'))


def draw_row_blocks(M, N, blocks, title_rows, title_part, out_name, owner=None):
    """A backward's two-stage column sum as a picture: ``M`` rows, each added into
    the partial row of the block that owns it, then the ``blocks`` partial rows added
    in order.  ``owner[i]``: the block of row ``i``; by default contiguous row blocks
    (the CPU's, cut by the package's ``n_chunks``); a GPU grid strides over the rows."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    contiguous = owner is None
    if contiguous:
        owner = [b for b in range(blocks) for _ in range(b * M // blocks, (b + 1) * M // blocks)]
    colors = plt.cm.tab10(np.arange(blocks) % 10)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    cell = 1.0 / max(M, 8)
    x0, xp, xs = 0.0, 1.6, 3.2           # left edges of the three arrays
    width = 1.0
    for i, b in enumerate(owner):        # row i, in its block's color
        ax.add_patch(Rectangle((x0, 1 - (i + 1) * cell), width, cell,
                               color=colors[b], alpha=0.35, lw=0))
    for b in range(blocks):
        rows = [i for i, o in enumerate(owner) if o == b]
        mid = 1 - (np.mean(rows) + 0.5) * cell
        if contiguous:
            ax.text(x0 - 0.05, mid, f"block {b}\nrows {rows[0]}-{rows[-1]}",
                    ha="right", va="center", fontsize=8)
        py = 1 - (b + 0.5) * (1.0 / blocks) * 0.6 - 0.2
        ax.add_patch(Rectangle((xp, py - 0.03), width, 0.06,
                               color=colors[b], alpha=0.8, lw=0))
        if not contiguous:
            ax.text(xp + width / 2, py, f"block {b}", ha="center", va="center", fontsize=7)
        for i in (rows if not contiguous else [None]):
            y = mid if i is None else 1 - (i + 0.5) * cell
            ax.add_artist(FancyArrowPatch(
                (x0 + width, y), (xp, py), arrowstyle="->", mutation_scale=8,
                color=colors[b], lw=0.8 if i is not None else 1.0))
        ax.add_artist(FancyArrowPatch(
            (xp + width, py), (xs, 0.5), arrowstyle="->", mutation_scale=10,
            color="0.4"))
    for y in np.arange(M + 1) * cell:
        ax.plot([x0, x0 + width], [1 - y, 1 - y], color="white", lw=0.4)
    ax.add_patch(Rectangle((xs, 0.47), width, 0.06, color="k", alpha=0.8))
    ax.text(x0 + width / 2, 1.05, title_rows, ha="center", fontsize=9)
    ax.text(xp + width / 2, 1.05, title_part, ha="center", fontsize=9)
    ax.text(xs + width / 2, 0.6, out_name, ha="center", fontsize=9)
    ax.text(xs + width / 2, 0.38, "fixed order:\npart 0 + part 1 + ...",
            ha="center", va="top", fontsize=8)
    ax.set_xlim(-0.9, xs + width + 0.1)
    ax.set_ylim(-0.05, 1.12)
    ax.axis("off")
    return fig


def draw_thread_mapping(cases):
    """The GPU kernels' row mapping (``numbanorm.cuda._kernels.common.row_config``) as a
    picture: for each ``(dtype name, N, cfg)``, the words (``cfg.vec`` elements: 16 bytes
    where the arrays allow, else 8, else one element) of the first rows of one block,
    coloured by the warp whose thread loads them.  Thread ``t`` of a row group
    owns words ``t, t + tpr, ...``: between two dashed lines, one load instruction of
    the group, every thread reading one word, neighbours reading neighbours."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cases), 1, figsize=(7.0, 1.5 + 1.1 * len(cases)), squeeze=False,
                             constrained_layout=True)
    for ax, (label, N, cfg) in zip(axes[:, 0], cases):
        words = -(-N // cfg.vec)
        shown = min(cfg.rows, 4)
        img = np.empty((shown, words))
        for r in range(shown):
            thread = r * cfg.tpr + np.arange(words) % cfg.tpr   # thread of the block
            img[r] = thread // 32                               # its warp
        ax.imshow(img, aspect="auto", cmap="tab20", vmin=0, vmax=19, interpolation="nearest")
        for k in range(cfg.tpr, words, cfg.tpr):
            ax.axvline(k - 0.5, color="black", lw=0.8, ls="--")
        ax.set_yticks(range(shown), [f"row {r}" for r in range(shown)])
        word = cfg.vec * np.dtype(label).itemsize
        ax.set_xlabel(f"{word}-byte word of the row ({cfg.vec} elements each)")
        more = f" ({shown} shown)" if cfg.rows > shown else ""
        ax.set_title(f"{label}, N = {N}: {cfg.tpr} threads per row, rows per block: {cfg.rows}{more}, "
                     f"{cfg.vpt} elements per thread", fontsize=9)
    return fig


# ------------------------------------------------------------------ committed results

BOOK = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(BOOK), "benchmarks", "results")   # the harness's files
BOOK_RESULTS = os.path.join(BOOK, "results")          # the book's own (experiments, history)
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
NAMES = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm", "group_norm": "GroupNorm",
         "instance_norm": "InstanceNorm"}


def load(name, folder=None):
    """A committed results file, by name (``cpu.json``), from ``benchmarks/results/`` or
    ``folder``; a missing one fails the build."""
    import json

    with open(os.path.join(RESULTS if folder is None else folder, name)) as f:
        return json.load(f)


def describe(name, run):
    """Print where and when a results file was measured (its ``meta``)."""
    meta, mach = run["meta"], run["meta"]["machine"]
    gpu = f", GPU: {mach['gpu']}" if mach.get("gpu") else ""
    print_wrapped(f"{name}: {mach['cpu']}, {mach['cores']} logical CPUs{gpu}, "
                  f"{meta.get('threads')} threads, measured {str(meta['date'])[:16]}; "
                  f"load average before {meta.get('loadavg_before')}, "
                  f"after {meta.get('loadavg_after')}")
    if meta.get("versions"):
        print_wrapped("  versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()
                                                 if v))
    if meta.get("note"):
        print_wrapped(f"  note: {meta['note']}")


def glue_all(**values):
    """Hand each value to the page's prose (``{glue:text}`name```), not displayed here."""
    from myst_nb import glue

    for name, value in values.items():
        glue(name, value, display=False)


def gpu_run():
    """The newest committed results file measured on a real GPU (its name and contents),
    or (None, None): a file whose ``meta.machine.gpu`` names a device and whose rows ran
    on it.  The CUDA simulator's numbers are never such a file."""
    import glob

    found = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        run = load(os.path.basename(path))
        if (isinstance(run, dict) and run.get("meta", {}).get("machine", {}).get("gpu")
                and any(r.get("device") == "gpu" for r in run.get("rows", []))):
            found.append((run["meta"]["date"], os.path.basename(path), run))
    return max(found, key=lambda t: t[0])[1:] if found else (None, None)


def gpu_or_simulator():
    """True where the CUDA driver reports a GPU; else numba's CUDA simulator is switched
    on (``NUMBA_ENABLE_CUDASIM``), which must happen before ``numba.cuda`` is first
    imported.  The driver is asked directly, without importing numba.cuda."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if (driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0
                and count.value > 0):
            return True
        break
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    return False


# ------------------------------------------------------------------ the benchmark sweeps

def cases(run, device):
    """{(norm, direction, shape, dtype, groups): {(impl, mode): row}} of ``device``."""
    out = {}
    for row in run["rows"]:
        if row["device"] == device:
            key = (row["norm"], row["direction"], tuple(row["shape"]), row["dtype"],
                   row["groups"])
            out.setdefault(key, {})[(row["impl"], row["mode"])] = row
    return out


def kernel_row(impls, mode=None):
    """numbanorm's row of a case: the preallocated forward (mode 'out') where there is
    one, else the allocating call; ``mode`` picks one."""
    mine = {k: r for k, r in impls.items() if k[0].startswith("numbanorm.")}
    if mode is not None:
        return next((r for k, r in mine.items() if k[1] == mode), None)
    return (next((r for k, r in mine.items() if k[1] == "out"), None)
            or next(iter(mine.values()), None))


def fraction_of_copy(impls):
    """numbanorm's GB/s over the copy floor's in the same case (1.0: as fast as a copy)."""
    k, floor = kernel_row(impls), impls.get(("floor", "out"))
    ok = k and floor and k["gbps"] and floor["gbps"]
    return k["gbps"] / floor["gbps"] if ok else None


def speedup_vs_torch(impls):
    """PyTorch's median time over numbanorm's, both allocating (above 1: numbanorm faster)."""
    k, t = kernel_row(impls, "alloc"), impls.get(("torch", "alloc"))
    return t["median_s"] / k["median_s"] if k and t and k["median_s"] else None


def summary_rows(run, device):
    """Per norm, direction and dtype: the cases, and the median [lowest, highest] of the
    fraction of the copy bandwidth and of the speed-up over PyTorch."""
    groups = {}
    for k, impls in cases(run, device).items():
        groups.setdefault((k[0], k[1], k[3]), []).append(impls)

    def fmt(v):
        return f"{np.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]" if v else "-"

    rows = []
    for (norm, d, dt), lst in sorted(groups.items()):
        frac = [v for v in map(fraction_of_copy, lst) if v is not None]
        spd = [v for v in map(speedup_vs_torch, lst) if v is not None]
        rows.append((NAMES[norm], d, dt, str(len(lst)), fmt(frac), fmt(spd)))
    return rows


SUMMARY_HEADER = ("norm", "direction", "dtype", "cases", "fraction of copy GB/s",
                  "speed-up over PyTorch")


def per_case_rows(run, device, norms):
    """One row per case of ``norms``: GB/s of numbanorm, PyTorch and the copy floor."""
    def gb(r):
        return f"{r['gbps']:.1f}" if r and r.get("gbps") else "-"

    rows = []
    for k, impls in sorted(cases(run, device).items()):
        if k[0] in norms:
            frac, spd = fraction_of_copy(impls), speedup_vs_torch(impls)
            g = f" G={k[4]}" if k[0] == "group_norm" else ""
            rows.append((NAMES[k[0]], k[1], f"{'x'.join(map(str, k[2]))}{g} {k[3]}",
                         gb(kernel_row(impls)), gb(impls.get(("torch", "alloc"))),
                         gb(impls.get(("floor", "out"))),
                         "-" if frac is None else f"{frac:.2f}",
                         "-" if spd is None else f"{spd:.2f}x"))
    return rows


PER_CASE_HEADER = ("norm", "direction", "case", "numbanorm GB/s", "PyTorch GB/s",
                   "copy GB/s", "fraction", "vs PyTorch")


def small_multiples(run, device, norm, dtype):
    """GB/s against the number of rows, one panel per (direction, hidden size):
    numbanorm, PyTorch and the copy floor, each with the 20-80 % band of its timings.
    Panels of a column share their x axis and a row its y axis, so the tick labels
    sit at the outer edges only and each title right above its own panel."""
    import matplotlib.pyplot as plt

    cs = {k: v for k, v in cases(run, device).items() if k[0] == norm and k[3] == dtype}
    if not cs:
        return None
    hidden = sorted({k[2][1] for k in cs})
    directions = [d for d in ("forward", "backward") if any(k[1] == d for k in cs)]
    panels = [(d, h) for d in directions for h in hidden]
    cols = 2   # two panels a row: legible at the page's width
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7.2, 2.5 * nrows + 0.9), squeeze=False,
                             sharex=True, sharey=True, layout="constrained")
    fig.get_layout_engine().set(h_pad=0.1, hspace=0.08)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    lines = [("numbanorm", lambda im: kernel_row(im), dict(color="C0", marker="o")),
             ("PyTorch", lambda im: im.get(("torch", "alloc")), dict(color="C1", marker="s")),
             ("copy floor", lambda im: im.get(("floor", "out")),
              dict(color="0.45", ls="--", marker=""))]
    for p, (d, h) in enumerate(panels):
        ax = axes.flat[p]
        pts = sorted((k[2][0], im) for k, im in cs.items() if k[1] == d and k[2][1] == h)
        m = [pt[0] for pt in pts]
        for label, pick, style in lines:
            rows = [pick(im) for _, im in pts]
            ys = [r["gbps"] if r and r.get("gbps") else np.nan for r in rows]
            if np.all(np.isnan(ys)):
                continue
            ax.plot(m, ys, label=label, ms=4, **style)
            lo = [r["bytes"] / r["q80_s"] / 1e9 if r and r.get("q80_s") else np.nan
                  for r in rows]
            hi = [r["bytes"] / r["q20_s"] / 1e9 if r and r.get("q20_s") else np.nan
                  for r in rows]
            ax.fill_between(m, lo, hi, color=style["color"], alpha=0.15, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{d}, hidden size {h}", fontsize=9.5, loc="left", pad=3)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.tick_params(labelbottom=True)   # every panel keeps its own row counts
        if p + cols >= len(panels):
            ax.set_xlabel("rows", fontsize=9)
        if p % cols == 0:
            ax.set_ylabel("GB/s", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"{NAMES[norm]}, {dtype}, {device.upper()}: effective bandwidth", fontsize=11)
    return fig


# ------------------------------------------------------------------ the roofline

def roofline_points(runs, device="cpu", shape=(16384, 4096)):
    """{(norm, direction, dtype): (FLOP per byte, GFLOP/s)} of the LayerNorm and RMSNorm
    kernels at ``shape`` in ``runs`` (results files of ONE machine, oldest first: a
    newer file's point replaces an older one's).  The forward into a preallocated output
    (as the copy writes), the backward allocating its dx (as the public function does)."""
    roofline = repo_module("benchmarks.roofline")
    pts = {}
    for run in runs:
        for r in run["rows"]:
            if (r["impl"].startswith("numbanorm.") and r["device"] == device
                    and r["norm"] in ("layer_norm", "rms_norm")
                    and tuple(r["shape"]) == tuple(shape) and r.get("gbps")
                    and r["mode"] == ("out" if r["direction"] == "forward" else "alloc")):
                i = roofline.intensity(r["norm"], r["direction"], r["dtype"])
                pts[(r["norm"], r["direction"], r["dtype"])] = (i, i * r["gbps"])
    return pts


def roofline_panels():
    """The roofline's panels, one per machine, each with its own roofs.

    CPU: one panel per committed ``roofline-*.json`` (both roofs measured by
    ``python -m benchmarks.roofline``), with the points of the benchmark files measured
    on the same machine (``meta.machine.cpu``); a machine with points but no roofs file
    is listed in ``missing``, not drawn under another machine's roofs.  GPU: the
    measured points of a real-GPU results file when one is committed (bandwidth roof: its
    device-to-device copy floor), else the static model's points under the H100's
    data-sheet roofs, labelled as a model.  Returns (panels, missing); a panel is a
    dict(title, kind, peak, bw, points, roofs)."""
    import glob

    roofline = repo_module("benchmarks.roofline")
    sweeps = [load(n) for n in ("cpu.json", "cpu-half.json")]
    by_machine = {}
    for run in sorted(sweeps, key=lambda r: r["meta"]["date"]):
        by_machine.setdefault(run["meta"]["machine"]["cpu"], []).append(run)
    panels, roofed = [], set()
    for path in sorted(glob.glob(os.path.join(RESULTS, "roofline-*.json"))):
        roof = load(os.path.basename(path))
        cpu = roof["meta"]["machine"]["cpu"]
        roofed.add(cpu)
        copies = roof["copy_gbps"]
        best = max(copies, key=lambda k: copies[k]["median"])
        panels.append(dict(
            title=f"{cpu}, {roof['meta']['threads']} threads (measured)", kind="cpu",
            peak=roof["peak_gflops"]["median"], bw=copies[best]["median"],
            points=roofline_points(by_machine.get(cpu, [])),
            roofs=f"roofs measured {roof['meta']['date'][:10]} ({os.path.basename(path)}): "
                  f"FMA loop {roof['peak_gflops']['median']:.0f} GFLOP/s, "
                  f"{best} {copies[best]['median']:.1f} GB/s"))
    missing = sorted(set(by_machine) - roofed)
    name, gpu = gpu_run()
    model = load("gpu-model.json")
    if gpu is not None:
        floors = [r["gbps"] for r in gpu["rows"] if r["impl"] == "floor" and r.get("gbps")
                  and tuple(r["shape"]) == (16384, 4096)]
        panels.append(dict(
            title=f"{gpu['meta']['machine']['gpu']} (measured)", kind="gpu",
            peak=GPU_PEAK_GFLOPS, bw=max(floors), points=roofline_points([gpu], "gpu"),
            roofs=f"points and bandwidth roof measured ({name}: device copy "
                  f"{max(floors):.0f} GB/s); compute roof from the data sheet"))
    pts = {}
    for rec in model["records"]:
        if rec["launch"] == "main" and rec["N"] == 4096 and rec["kernel"] in (
                "layer_norm_forward", "layer_norm_backward", "rms_norm_forward",
                "rms_norm_backward"):
            norm, direction = rec["kernel"].rsplit("_", 1)
            frac = rec["memory_clocks_per_row"] / max(rec["memory_clocks_per_row"],
                                                      rec["issue_clocks_per_row"])
            i = roofline.intensity(norm, direction, rec["dtype"])
            pts[(norm, direction, rec["dtype"])] = (i, i * frac * model["model"]["dram_bytes_per_s"] / 1e9)
    panels.append(dict(
        title=f"{model['model']['gpu']}: a MODEL, not a measurement", kind="model",
        peak=GPU_PEAK_GFLOPS, bw=model["model"]["dram_bytes_per_s"] / 1e9, points=pts,
        roofs="roofs from the data sheet (bandwidth as gpu_model.py takes it); points "
              "predicted from the kernels' SASS (gpu-model.json), N = 4096"))
    return panels, missing


GPU_PEAK_GFLOPS = 67e3   # H100 SXM data sheet: float32 without tensor cores


def draw_roofline(panels):
    """The panels one under the other, each the page's width, a shared legend below:
    colour is the kernel, marker the dtype (every dtype plotted has its entry)."""
    import matplotlib.pyplot as plt

    marks = {"float16": "s", "bfloat16": "^", "float32": "o", "float64": "D"}
    colors = {("layer_norm", "forward"): "C0", ("layer_norm", "backward"): "C1",
              ("rms_norm", "forward"): "C2", ("rms_norm", "backward"): "C3"}
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.0, 3.5 * len(panels) + 0.7),
                             squeeze=False, layout="constrained")
    fig.get_layout_engine().set(h_pad=0.15)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    dtypes = set()
    for ax, p in zip(axes.flat, panels):
        ridge = p["peak"] / p["bw"]
        xs = np.logspace(np.log10(ridge) - 2.5, np.log10(ridge) + 1, 300)
        ax.plot(xs, np.minimum(p["peak"], xs * p["bw"]), color="0.2", lw=2)
        ax.axvline(ridge, color="0.5", ls=":", lw=1.2)
        ax.set_xlim(xs[0], xs[-1])
        ax.set_ylim(xs[0] * p["bw"] / 2, p["peak"] * 4)
        ax.annotate(f"ridge {ridge:.1f} FLOP/B", (ridge, xs[0] * p["bw"] / 2), xytext=(4, 4),
                    textcoords="offset points", fontsize=8, color="0.3")
        ax.text(0.03, 0.97, f"slanted roof: copy, {p['bw']:.0f} GB/s", fontsize=8,
                color="0.3", transform=ax.transAxes, va="top")
        ax.annotate(f"peak {p['peak']:.0f} GFLOP/s", (xs[-1], p["peak"]), xytext=(-4, 5),
                    textcoords="offset points", fontsize=8, color="0.3", ha="right")
        for (norm, d, dt), (i, gf) in sorted(p["points"].items()):
            dtypes.add(dt)
            ax.plot(i, gf, marks[dt], color=colors[(norm, d)], ms=7, alpha=0.9,
                    markeredgecolor="white", markeredgewidth=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("FLOP per byte moved", fontsize=9)
        ax.set_ylabel("GFLOP/s", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.set_title(p["title"], fontsize=10.5, loc="left")
        ax.grid(alpha=0.3, which="both")
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=f"{NAMES[n]} {d}")
               for (n, d), c in colors.items()]
    handles += [plt.Line2D([], [], color="0.4", marker=m, ls="", label=dt)
                for dt, m in marks.items() if dt in dtypes]
    handles += [plt.Line2D([], [], color="0.2", lw=2, label="roofs"),
                plt.Line2D([], [], color="0.5", ls=":", label="ridge")]
    fig.legend(handles=handles, loc="outside lower center", ncol=5, fontsize=8.5,
               frameon=False)
    return fig


# ------------------------------------------------------------------ the design log

def history(story):
    """Show one story of ``book/results/design-log.json`` as a table: what was measured,
    the values, the unit and the commit that recorded them."""
    log = load("design-log.json", BOOK_RESULTS)["stories"][story]
    rows = []
    for r in log["rows"]:
        fmt = ".2f" if r["unit"] == "x" else "g"   # ratios as the text gave them: 1.30x
        values = ", ".join(format(v, fmt) if isinstance(v, float) else str(v)
                           for v in r["values"])
        at = f" (at {r['at']})" if r.get("at") else ""
        rows.append((r["case"] + at, values, r["unit"], r["source"]))
    print_wrapped(log["title"])
    show_table(("measured", "values", "unit", "recorded in"), rows, text_cols=1)


# ------------------------------------------------------------------ chapter 10's experiments

def band(ax, x, runs, color, label, **style):
    """Mean over seeds as a line, their range as a band; a diverged run (NaN)
    drops out of both, and the label says how many did."""
    runs = np.array(runs, dtype=float)      # JSON null (diverged) -> NaN
    lost = int(np.isnan(runs[:, -1]).sum())
    if lost:
        label += f" ({lost} of {len(runs)} diverged)"
    with warnings.catch_warnings():         # a step where every run is NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        ax.plot(x, np.nanmean(runs, axis=0), color=color, label=label, **style)
        ax.fill_between(x, np.nanmin(runs, axis=0), np.nanmax(runs, axis=0),
                        color=color, alpha=0.15, lw=0)


@contextlib.contextmanager
def one_thread():
    """numbanorm's kernels and BLAS on one thread, for tiny arrays.

    The arrays in these loops are a few KiB: there is nothing to split between
    threads, and on a busy machine a parallel launch can wait milliseconds
    for a descheduled thread.
    """
    import numba
    from threadpoolctl import threadpool_limits

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with threadpool_limits(1):
            yield
    finally:
        numba.set_num_threads(threads)


def plot_warmup(warm):
    """Chapter 10's Pre-LN/Post-LN warm-up runs (book/results/warmup.json): the
    figure, the table, and the numbers its prose states, returned for glue_all."""
    import matplotlib.pyplot as plt

    out = {}
    wcfg = warm["settings"]
    for k, v in wcfg.items():  # the prose states the run's settings from the file
        if isinstance(v, (int, float)):
            out[f"warmcfg_{k}"] = v
    styles = {("Post-LN", False): ("C3", "-"), ("Post-LN", True): ("C3", "--"),
              ("Pre-LN", False): ("C0", "-"), ("Pre-LN", True): ("C0", "--")}

    def warm_runs(lr, placement, warmup):
        return [r for r in warm["results"] if r["lr"] == lr
                and r["placement"] == placement and r["warmup"] == warmup]

    w = wcfg["smooth"]
    fig, axes = plt.subplots(1, len(wcfg["lrs"]), figsize=(10, 4), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, lr in zip(axes, wcfg["lrs"]):
        for (placement, warmup), (color, ls) in styles.items():
            rs = warm_runs(lr, placement, warmup)
            steps = w * np.arange(len(rs[0]["curve"])) + w / 2
            band(ax, steps, [r["curve"] for r in rs], color,
                 f"{placement}, {'warm-up' if warmup else 'no warm-up'}", ls=ls)
        ax.axvline(wcfg["warmup"], color="0.5", lw=0.8, ls=":", label="end of warm-up")
        ax.axhline(np.log(wcfg["vocab"]), color="k", lw=0.8, ls=":",
                   label=f"uniform guess, ln {wcfg['vocab']}")
        ax.set_yscale("log")
        ax.set_title(f"Adam, learning rate {lr:g}")
        ax.set_xlabel("training step")
    axes[0].set_ylabel(f"training loss ({w}-step mean)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    plt.show()

    print(f"{'':8s} {'warm-up':8s} {'lr':>6s} {'final loss':>16s} "
          f"{'test accuracy':>16s} {'diverged':>8s}")
    for lr, tag in zip(sorted(wcfg["lrs"]), ["lo", "hi"]):
        out[f"warm_lr_{tag}"] = lr
        for placement, warmup in styles:
            rs = warm_runs(lr, placement, warmup)
            loss = np.array([np.nan if r["final_loss"] is None else r["final_loss"]
                             for r in rs])
            acc = np.array([r["test_accuracy"] for r in rs])
            print(f"{placement:8s} {'yes' if warmup else 'no':8s} {lr:6g} "
                  f"{np.nanmean(loss):8.3f} ± {np.nanstd(loss):.3f} "
                  f"{acc.mean():8.3f} ± {acc.std():.3f} "
                  f"{np.isnan(loss).sum():5d}/{len(rs)}")
            key = f"{placement[:-3].lower()}_{'warm' if warmup else 'cold'}_{tag}"
            out[f"loss_{key}"] = float(np.nanmean(loss))
            out[f"lossstd_{key}"] = float(np.nanstd(loss))
            out[f"acc_{key}"] = float(acc.mean())
    out["warm_seeds"] = len(wcfg["seeds"])
    print(f"(run {warm['created']}: {warm['seconds'] / 60:.0f} minutes for "
          f"{len(warm['results'])} trainings, numbanorm "
          f"{warm['versions']['numbanorm']}, torch {warm['versions']['torch']})")
    return out


def plot_adding(adding):
    """Chapter 10's LSTM adding-task runs (book/results/lstm_adding.json): the figure,
    the table, and the numbers its prose states, returned for glue_all."""
    import matplotlib.pyplot as plt

    out = {}
    acfg = adding["settings"]
    for k, v in acfg.items():
        if isinstance(v, (int, float)):
            out[f"addcfg_{k}"] = v
    conditions = acfg["conditions"]                  # (T, the values' scale) pairs
    fig, axes = plt.subplots(1, len(conditions), figsize=(10, 3.8), sharey=True,
                             squeeze=False)
    axes = axes[0]
    w = acfg["smooth"]

    def adding_runs(ln, T, scale):
        return [r for r in adding["results"]
                if r["ln"] == ln and r["T"] == T and r["scale"] == scale]

    for ax, (T, scale) in zip(axes, conditions):
        for ln, color in [(False, "0.35"), (True, "C0")]:
            curves = np.array([r["curve"] for r in adding_runs(ln, T, scale)])
            steps = w * np.arange(curves.shape[1]) + w / 2
            name = "LayerNorm LSTM" if ln else "LSTM"
            for i, c in enumerate(curves):       # one thin line per seed
                ax.plot(steps, c, color=color, lw=0.7, alpha=0.6,
                        label=f"{name}, each seed" if i == 0 else None)
            ax.plot(steps, np.median(curves, axis=0), color=color, lw=2,
                    label=f"{name}, median")
        ax.axhline(1 / 6, color="k", ls=":", lw=1, label="predict the mean")
        ax.set_yscale("log")
        ax.set_title(f"T = {T}, values × {scale:g}", fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"MSE ({w}-step mean)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    plt.show()

    def solved_at(curve, level=1 / 60):
        """First step whose smoothed MSE is below a tenth of predicting the mean."""
        below = np.flatnonzero(np.array(curve) < level)
        return w * (below[0] + 1) if len(below) else np.inf    # never

    print_wrapped(f"final MSE: mean of the last {acfg['final_window']} batches, mean ± std "
                  f"over {len(acfg['seeds'])} seeds; step at which the MSE first fell below "
                  "1/60, per seed")
    for T, scale in conditions:
        for ln in (False, True):
            rs = adding_runs(ln, T, scale)
            final = np.array([r["final_mse"] for r in rs])
            when = np.array([solved_at(r["curve"]) for r in rs])
            name = "LayerNorm LSTM" if ln else "LSTM"
            print(f"  T {T:3d}, x{scale:<3g} {name:15s} {final.mean():.4f} ± "
                  f"{final.std():.4f}   below 1/60 at steps "
                  f"{', '.join('never' if np.isinf(v) else f'{v:.0f}' for v in when)}")
            key = f"{'ln' if ln else 'plain'}_T{T}_x{scale:g}"
            out[f"adding_{key}"] = float(final.mean())
            out[f"addingstd_{key}"] = float(final.std())
            out[f"solved_{key}"] = float(np.median(when))
    out["adding_seeds"] = len(acfg["seeds"])
    out["adding_steps"] = acfg["steps"]
    print(f"(run {adding['created']}: {adding['seconds'] / 60:.0f} minutes, numbanorm "
          f"{adding['versions']['numbanorm']})")
    return out
