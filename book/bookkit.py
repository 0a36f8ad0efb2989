"""What the book's chapters share: BatchNorm in NumPy and the build stamp.

Chapter 1 shows ``BatchNorm1d`` with ``literalinclude`` and chapter 10 trains
with it, so both read this one definition.  The LayerNorm the book uses is
numbanorm's own; numbanorm ships no BatchNorm, so the book brings this one as
its point of comparison.  (Lines stay under 80 columns: the book shows them.)
"""

import datetime
import os
import platform
import textwrap

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
    import importlib
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks.readme_table")


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
