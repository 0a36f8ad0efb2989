"""Every number in the book's prose is computed, loaded, or declared as a setting or a definition.

    python book/check_numbers.py            # every page of book/; exits non-zero naming each number
    python book/check_numbers.py PAGE.md    # some pages only

The book's rule (intro.md) is that every number a page states is computed when the page
is built or read from a committed results file.  In the Markdown, a computed number
reaches the prose through a role, ``{glue:text}`name``` (the page's code cell computes
it and ``myst_nb.glue`` hands it over), and a loaded one the same way or in a cell's
output; neither is prose this check reads.  What it reads is what MyST parses as text:
paragraphs, headings, list items, table cells, and the body of admonitions and of the
glossary.  Not prose: code cells and listings, any other directive, inline code, math
(``$...$``, ``$$...$$``, amsmath environments), roles, HTML and comments.

In that text a *number* is a run of digits (a sign, thousands commas, a decimal part, an
exponent, and an ``x``, ``×`` or ``%`` after it included) that does not stand inside a
word: ``float32``, ``sm_90``, ``x86-64``, ``AVX-512`` and ``L2`` are names.  A number is
allowed only

* as structure: a chapter's number at the start of its title (``# 5. Writing ...``) and
  references to chapters (``chapter 4``, ``chapters 5 to 9``); or
* inside a phrase that :data:`DECLARED` lists for its page (or for every page, ``"*"``),
  with its kind: ``setting`` (a value the text chose and the code uses: a shape, a
  batch size, a seed count), ``definition`` (a fact of a format, an algorithm or a
  machine that does not change between runs: float16's 11-bit significand, a warp of 32
  threads, a 64-byte cache line) or ``literature`` (a figure a cited source reports).

A declared phrase that stated a measurement (a time, a bandwidth, a ratio, a
percentage) as a setting or a definition would defeat the check, so such a phrase may
only be ``literature``; and a declared phrase that no longer occurs on its page is an
error too, so that the list cannot outlive the text.  ``tests/test_book_numbers.py``
runs this check on the book and shows that it catches a typed number.
"""

from __future__ import annotations

import pathlib
import re
import sys
import textwrap

from markdown_it import MarkdownIt
from mdit_py_plugins.amsmath import amsmath_plugin
from mdit_py_plugins.colon_fence import colon_fence_plugin
from mdit_py_plugins.dollarmath import dollarmath_plugin
from mdit_py_plugins.front_matter import front_matter_plugin
from mdit_py_plugins.myst_blocks import myst_block_plugin
from mdit_py_plugins.myst_role import myst_role_plugin

BOOK = pathlib.Path(__file__).resolve().parent

# the plugins myst-parser enables for the book's extensions (_config.yml): dollarmath,
# amsmath, colon_fence; roles, targets and comments are MyST's own syntax
PARSER = (MarkdownIt("commonmark").enable("table")
          .use(front_matter_plugin).use(myst_block_plugin).use(myst_role_plugin)
          .use(dollarmath_plugin).use(amsmath_plugin).use(colon_fence_plugin))

# directives whose body is prose (parsed again, as MyST does); any other directive's body
# (code-cell, literalinclude, eval-rst, math, ...) is code or markup
PROSE_DIRECTIVES = {"note", "tip", "hint", "important", "attention", "caution", "warning",
                    "danger", "error", "seealso", "admonition", "margin", "sidebar",
                    "topic", "dropdown", "glossary", "epigraph"}

NOT_TEXT = "\u25c7"   # stands in for inline code, math and roles: no digit can come from it
NUMBER = re.compile(
    r"(?<![\w.])(?<!\w-)"                       # not inside a word: x86-64, AVX-512, v1.2
    r"[-+\u2212]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?"
    r"(?:x|\u00d7|\s?%)?"                       # a ratio or a percentage
    r"(?![\w])")
STRUCTURE = [
    re.compile(r"^\d+\.\s"),                                      # "# 5. Writing ..."
    re.compile(r"\b[Cc]hapters?\s+\d+(?:\s*(?:,|to|and|or|-|\u2013)\s*\d+)*"),
]
# what a measurement looks like: a phrase holding one may only be declared as literature
MEASUREMENT = re.compile(
    r"\d\s*(?:x\b(?!\s*\d)|\u00d7(?!\s?\d)|ms\b|\u00b5s\b|us\b|ns\b|s\b|seconds?\b|minutes?\b|"
    r"[GMT]B/s|GFLOP/s|TFLOP/s|%\s*(?:faster|slower|less|more)|times (?:faster|slower))")
KINDS = {"setting", "definition", "literature"}

# Declared phrases, per page: (phrase, kind, why).  A phrase is literal text (whitespace
# as in the prose, NOT_TEXT where inline code, math or a role stands) or a compiled
# regular expression.
DECLARED: dict[str, list[tuple[str | re.Pattern, str, str]]] = {
    "*": [
        (re.compile(r"\b(?:8|16|32|64|128|256|512)-(?:bit|byte)\b"), "definition",
         "the widths of number formats, machine words, vectors and cache lines"),
        (re.compile(r"\b(?:8|11|16|24|32|53|64|128|256|512) bits\b"), "definition",
         "the widths of formats, significands and vectors"),
        (re.compile(r"\b(?:above|below|under|over|near|at) 1(?:\.0)?\b"), "definition",
         "1 as the point of a ratio of two times where they are equal"),
        (re.compile(r"\bexactly 0\b"), "definition", "an exact zero"),
        (re.compile(r"\b[Pp]ass(?:es)? [123]\b"), "definition", "the names of a kernel's passes"),
        (re.compile(r"\bGroupNorm\(1\)"), "definition", "GroupNorm with one group, by its call"),
        (re.compile(r"\b20-80 % range|\b80 % quantile|\b20 % quantile"), "definition",
         "the quantiles the benchmark files keep"),
    ],
    "01_why_normalize.md": [
        ("(0.8, 1.0, 1.2:", "setting", "the gains of the depth demo"),
        ("through 30 layers", "setting", "the depth of the demo"),
        ("a gain of 1.2 per layer", "setting", "the demo's gains"),
        ("after 30 layers, and a gain of 0.8", "setting", "the demo's gains"),
        ("in 14 times fewer training steps", "literature", "Ioffe and Szegedy's result"),
        ("batch size 1", "definition", "BatchNorm's degenerate case"),
        ("momentum 0.1", "setting", "PyTorch's default, which the NumPy BatchNorm uses"),
        ("into 300 different batches", "setting", "the demo's sample count"),
        ("sees 500 training batches", "setting", "the demo's training length"),
        ("With batches of 64", "setting", "the demo's batch sizes"),
        ("with batches of 2", "setting", "the demo's batch sizes"),
        ("batch sizes 2 and 64", "setting", "chapter 10's batch sizes"),
        ("at batch size 2 and is undefined at 1", "definition", "BatchNorm's small batches"),
    ],
    "02_layernorm_math.md": [
        ("which is 1 up to", "definition", "a unit mean square"),
        ("300 random rows", "setting", "the picture's sample"),
        ("(4 groups of the 16 units)", "setting", "the demo's GroupNorm"),
    ],
    "04_numerics.md": [
        ("chunks of 16 elements", "setting", "the cascaded update's chunk"),
        ("(which should be 1)", "definition", "a unit standard deviation"),
        ("from 1 to", "setting", "the sweep's range"),
        ("from 3 to", "setting", "the fitted range"),
        ("reaches 100% at", "definition", "a relative error of one: a useless result"),
        ("sum of 4096 values", "setting", "the demo's row length"),
        ("its 4096-step chain: each chunk sees 16 roundings", "setting", "the demo's row and chunk"),
        ("first 16 elements", "setting", "the CPU kernel's SHIFT_SAMPLE"),
        ("5% of", "definition", "half the float32 spacing near 1e4 over the row's sigma"),
        ("by up to 0.05", "definition", "the same, in units of sigma"),
        ("an 11-bit significand: numbers between 2048 and 4096 are spaced 2 apart",
         "definition", "float16's format"),
        ("largest finite value is 65504", "definition", "float16's format"),
        ("Summing 4096 ones", "setting", "the demo's sum"),
        ("From 2048 on", "definition", "where float16 stops counting"),
        ("between 2048 and 2050", "definition", "float16's spacing there"),
        ("significand, 2048", "definition", "float16's spacing there"),
        ("standard deviation 8 overflows", "definition", "float16's range for a sum of squares"),
        ("but reduce in 32", "definition", "float32 accumulation"),
        ("even sooner, at 256", "definition", "where bfloat16 stops counting"),
        ("times 316", "definition", "1/sqrt(1e-5)"),
        ("of 768 copies of 3.7 need not be exactly 3.7", "setting", "the demo's row"),
        ("an RMS of 0.03", "definition", "the square root of float16's epsilon"),
        ("= 4096 elements", "definition", "the value of SUM_BLOCK"),
        ("(mean 300, standard deviation 1)", "setting", "the 16-bit rows of the demo"),
        ("becomes 0 and every output 0", "definition", "an overflowed row"),
        ("(4096 ones sum to 2048) and overflow (past 65504)", "definition", "float16's limits"),
    ],
    "05_cpu_kernel.md": [
        ("moves 8 bytes per float32 element", "definition", "a float32 read and write"),
        ("memory delivers 8 bytes", "definition", "the same bytes"),
        ("a 4096 x 1024 float32 problem", "setting", "the live probe's shape"),
        ("are 16 bytes an element in float32", "definition", "four float32 arrays"),
        ("fit a 48 KiB L1 data cache", "definition", "the L1 data cache of Zen 5 and Emerald Rapids"),
        ("a float32 row of 4096 elements with both parameters is 48 KiB", "definition",
         "three float32 rows of 4096 elements"),
        ("over the 32 KiB of AMD's Zen 3 and Zen 4", "definition", "the L1 data cache of Zen 3 and Zen 4, per core"),
    ],
    "06_gpu_kernel.md": [
        ("offsets 16, 8, 4, 2 and 1", "definition", "a warp's butterfly"),
        ("lane 0", "definition", "the first lane of a warp"),
        ("(3 blocks of 2 rows each)", "setting", "the picture's grid"),
        ("Load 16 bytes per thread", "definition", "a 16-byte word"),
        ("a row kernel of 1024 to 8192 elements a row", "setting", "the row lengths CI's gate holds"),
        ("at row lengths up to 8192", "setting", "the row lengths CI's gate holds"),
        ("(from 1024 up)", "setting", "the row lengths of the gate's in-flight check"),
    ],
    "08_groupnorm.md": [
        ("on a 3-D", "definition", "a spatial dimension count"),
        ("with 32 images per GPU down to 2", "literature", "Wu and He's settings"),
        ("(0.1 at 32)", "literature", "Wu and He's learning rate"),
        ("at 2 images per GPU GroupNorm's error was 10.6 points lower", "literature",
         "Wu and He's result"),
        ("1797 handwritten digits, upsampled from 8×8 to 16×16 pixels", "setting",
         "the data set and the experiment's size"),
        ("five 3×3 convolutions", "setting", "the network"),
        ("2×2 max-pooling", "setting", "the network"),
        ("SGD (momentum 0.9)", "setting", "the optimizer"),
        ("every batch size from 2 to 64", "setting", "the sweep"),
        ("at batch size 2 to", "setting", "the sweep's ends"),
        ("at 64. The dotted line", "setting", "the sweep's ends"),
        ("a batch of 2 test images", "setting", "the sweep's smallest batch"),
        ("at 2 and", "setting", "the sweep's batch sizes"),
        ("at 4, against", "setting", "the sweep's batch sizes"),
        ("from batches of 64", "setting", "the sweep's largest batch"),
        ("On 16×16 digits", "setting", "the experiment's size"),
        ("at batch size 2)", "setting", "the sweep's ends"),
        ("towards batch size 64", "setting", "the sweep's ends"),
        ("so batch size 64 takes 32 times fewer steps than batch size 2", "definition",
         "the step counts of equal epochs"),
        ("A first run with 3 epochs", "setting", "an earlier run's setting"),
    ],
    "09_performance.md": [
        ("at 16384 x 4096", "setting", "the roofline's shape"),
    ],
    "10_experiments.md": [
        ("at batch sizes 2 and 64", "setting", "the sweep (tests/test_book_experiments.py)"),
        ("(1797 images of 8×8 pixels)", "setting", "the data set"),
        ("64 → 128 → norm → ReLU → 128 → norm → ReLU → 10", "setting", "the network"),
        ("momentum 0.9", "setting", "the optimizer"),
        ("batch size 2 takes 32 times as many steps", "definition",
         "the step counts of equal epochs"),
        ("At batch size 2", "setting", "the sweep's smallest batch"),
        ("at batch size 64", "setting", "the sweep's largest batch"),
        ("at batch size 2 and", "setting", "the sweep's ends"),
        ("at 64. A network", "setting", "the sweep's ends"),
        ("at depth 96", "setting", "the deepest stack"),
        ("among the 16 tokens", "setting", "the task's vocabulary"),
        ("over 300 steps, the 75 spent", "setting", "the warm-up run (tests/test_book_experiments.py)"),
        ("Predicting the mean, 1,", "definition", "the adding task's target mean"),
        ("multiplied by 10", "setting", "the badly scaled input"),
        ("After 1000 steps", "setting", "the LSTM runs' length"),
        ("Values scaled by 10", "setting", "the badly scaled input"),
        ("(the markers stay 0 and 1)", "definition", "the adding task's markers"),
        ("which at scale 1 keeps", "setting", "the input scales"),
        ("at scale 10 no longer", "setting", "the input scales"),
        ("BatchNorm at batch size 2 trains", "setting", "the sweep's smallest batch"),
        ("On values scaled by 10", "setting", "the badly scaled input"),
    ],
    "11_pytorch.md": [
        ("one 1-D", "definition", "a vector"),
    ],
    "12_dask.md": [
        ("fall short of 1 by", "definition", "a unit standard deviation"),
    ],
    "log_gpu.md": [
        ("(for 4096 rows)", "setting", "the table's row count"),
    ],
    "log_cpu.md": [
        ("shifted right by 62", "definition", "the opaque zero's construction"),
        ("A (1, N) float32 forward", "definition", "one row"),
        ("rows of 1024 values", "setting", "the sweep's rows"),
        ("this CPU's 48 KiB L1 data cache", "definition", "Zen 5's L1 data cache, per core"),
        ("a shared 2-CPU virtual machine", "definition", "the VM the spread was measured on"),
        ("forward at 16384 x 4096 must take", "setting", "the 16-bit targets' case"),
        ("in 4 KiB pages", "definition", "the base page size of x86-64 Linux"),
        ("In 4 KiB pages", "definition", "the base page size of x86-64 Linux"),
        ("forwards at (8, 64, 64, 64) must take", "setting", "the GroupNorm targets' case"),
        ("A float32 row of 4096 elements with weight and bias is 48 KiB", "definition",
         "three float32 rows of 4096 elements"),
        ("L1 data cache of Zen 5 and Emerald Rapids, over Zen 4's 32 KiB", "definition",
         "the L1 data caches of those CPUs, per core"),
        ("and weight, 32 KiB, are still written whole", "definition", "two float32 rows of 4096 elements"),
        ("with 16-bit parameters are 24 KiB", "definition", "three 16-bit rows of 4096 elements"),
    ],
}


def prose(inline):
    """The text of an inline token, with NOT_TEXT where code, math or a role stands."""
    parts = []
    for child in inline.children or ():
        if child.type == "text":
            parts.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            parts.append(" ")
        elif child.type in ("code_inline", "math_inline", "math_inline_double",
                            "myst_role", "html_inline", "image"):
            parts.append(NOT_TEXT)
    return re.sub(r"\s+", " ", "".join(parts))


def prose_blocks(text):
    """(line, text, is_title) of every piece of prose of a page's Markdown."""
    out = []
    tokens = PARSER.parse(text)
    for i, tok in enumerate(tokens):
        if tok.type == "inline":
            title = i > 0 and tokens[i - 1].type == "heading_open" and tokens[i - 1].tag == "h1"
            out.append((tok.map[0] + 1 if tok.map else 0, prose(tok), title))
        elif tok.type in ("fence", "colon_fence"):
            name = re.match(r"\s*\{([\w:-]+)\}", tok.info or "")
            if name and name.group(1) in PROSE_DIRECTIVES:
                body = [line for line in tok.content.splitlines()
                        if not re.match(r"\s*:[\w-]+:", line)]   # the directive's options
                title = (tok.info or "")[name.end():].strip()
                offset = tok.map[0] + 1 if tok.map else 0
                if title:
                    out.append((offset, prose(PARSER.parseInline(title)[0]), False))
                for line, block, _ in prose_blocks(textwrap.dedent("\n".join(body))):
                    out.append((offset + line, block, False))
    return out


def spans(pattern, text):
    if isinstance(pattern, re.Pattern):
        return [m.span() for m in pattern.finditer(text)]
    return [(m.start(), m.start() + len(pattern)) for m in re.finditer(re.escape(pattern), text)]


def shown(phrase):
    return phrase.pattern if isinstance(phrase, re.Pattern) else phrase


def check_text(page, text, declarations=None):
    """The findings of one page (strings; none when every number is allowed).
    ``declarations``: the page's own, DECLARED[page] by default; DECLARED["*"] apply
    too, and need not occur on every page."""
    own = DECLARED.get(page, []) if declarations is None else declarations
    everywhere = DECLARED.get("*", [])
    findings, used = [], set()
    for phrase, kind, _ in own + everywhere:
        if kind not in KINDS:
            findings.append(f"{page}: declared {shown(phrase)!r}: kind {kind!r} is not "
                            f"one of {sorted(KINDS)}")
        if kind != "literature" and MEASUREMENT.search(shown(phrase)):
            findings.append(f"{page}: declared {shown(phrase)!r} as a {kind}, but it states "
                            "a measurement: compute it or load it from a results file")
    for line, block, title in prose_blocks(text):
        allowed = []
        for pattern in STRUCTURE:
            if title or not pattern.pattern.startswith("^"):
                allowed += spans(pattern, block)
        for k, (phrase, _, _) in enumerate(own + everywhere):
            found = spans(phrase, block)
            used.update([k] if found else [])
            allowed += found
        for m in NUMBER.finditer(block):
            if not any(a <= m.start() and m.end() <= b for a, b in allowed):
                context = block[max(0, m.start() - 40):m.end() + 30]
                findings.append(f'{page}:{line}: {m.group().strip()!r} in "...{context}..."')
    for k, (phrase, kind, _) in enumerate(own):
        if k not in used:
            findings.append(f"{page}: the declared {kind} {shown(phrase)!r} no longer "
                            "occurs on the page")
    return findings


def pages(book=BOOK):
    return sorted(book.glob("*.md"))


def check(paths=None):
    """The findings of the given pages (all of the book's by default)."""
    paths = pages() if paths is None else [pathlib.Path(p) for p in paths]
    findings = [f"{name}: declared for a page that does not exist"
                for name in sorted(set(DECLARED) - {"*"} - {p.name for p in pages()})]
    for path in paths:
        findings += check_text(path.name, path.read_text())
    return findings


def main(argv):
    findings = check(argv or None)
    for f in findings:
        print(f)
    if findings:
        sys.exit(f"check_numbers: {len(findings)} numbers in the prose neither computed, loaded "
                 "nor declared (book/check_numbers.py says how to declare a setting)")
    print(f"check_numbers: every number in the prose of {len(argv) or len(pages())} pages is "
          "computed, loaded or declared")


if __name__ == "__main__":
    main(sys.argv[1:])
