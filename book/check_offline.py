"""Check that the built book renders with no network, and that nothing in it scrolls sideways.

    python book/check_offline.py book/_build/html

Every page must load its scripts from the book itself (no ``<script src="http...">``).
Every page is then opened in headless Chromium, at a desktop window width and with
every host name unresolvable, and

* every math element of the page must have become a MathJax ``mjx-container`` (raw TeX
  is what a reader without network would otherwise see), and
* no code block (a cell's input or output, a listing) and no typeset display equation
  may be wider than the column it stands in: a reader would have to scroll it sideways.

The widths are measured in the page itself: a copy of the page, written beside it for
the run, ends with a small script (``MEASURE``) that waits for MathJax to finish, measures
the elements and writes what is too wide into the DOM, which ``--dump-dom`` then returns.
Exits non-zero naming the pages, and in them the elements, that fail.
"""

import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

WINDOW = (1280, 900)   # a desktop window: the book theme shows its sidebar and full column
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", f"--window-size={WINDOW[0]},{WINDOW[1]}",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no host resolves: the page is offline
    "--virtual-time-budget=20000",            # let MathJax typeset before the DOM dump
]
REMOTE_SCRIPT = re.compile(r'<script[^>]+src="(https?:)?//', re.I)
MATH = re.compile(r'class="[^"]*\bmath\b[^"]*"')
REPORT = re.compile(r'<script type="application/json" id="check-offline-widths">(.*?)</script>',
                    re.S)

# Elements allowed to be wider than their column, each with the reason a reader scrolls
# it on purpose: a CSS selector matched with Element.matches().  None today.
EXEMPT = {}

# Appended to a copy of each page.  Waits for MathJax (when the page loads it) to finish
# typesetting and for the fonts, then lists every code block and display equation whose
# content is wider than the box it is shown in (more than 1 px: sub-pixel rounding).
MEASURE = """
<script>
(async () => {
  const exempt = %(exempt)s;
  const report = [];
  try {
    if (document.querySelector('script[src*="tex-svg"]')) {
      while (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) {
        await new Promise(r => setTimeout(r, 50));
      }
      await MathJax.startup.promise;
    }
    await document.fonts.ready;
    const tex = new Map();
    if (window.MathJax && MathJax.startup && MathJax.startup.document) {
      for (const m of MathJax.startup.document.math) tex.set(m.typesetRoot, m.math);
    }
    const where = el => {
      const h = [...document.querySelectorAll("section[id]")].filter(s => s.contains(el)).pop();
      return h ? "#" + h.id : "top";
    };
    const say = s => s.replace(/\\s+/g, " ").trim().slice(0, 70);
    const wide = (kind, el, what, content, box) => {
      if (content <= box + 1) return;
      const why = Object.keys(exempt).find(sel => el.matches(sel));
      if (why === undefined) {
        report.push(`${kind} in ${where(el)} is ${Math.ceil(content)} px wide in a `
                    + `${Math.floor(box)} px column: ${say(what)}`);
      }
    };
    // code: listings and cell inputs (div.highlight pre), cell outputs (their pre)
    const code = new Set(document.querySelectorAll(
      "div.highlight pre, div.cell_output pre, div.output pre"));
    for (const pre of code) {
      const kind = pre.closest(".cell_output, .output") ? "cell output"
                 : pre.closest(".cell_input") ? "cell input" : "code block";
      wide(kind, pre, pre.textContent, pre.scrollWidth, pre.clientWidth);
    }
    // tables a cell shows (HTML outputs): against the output's own width
    for (const t of document.querySelectorAll(".cell_output table")) {
      const box = t.closest(".cell_output");
      wide("output table", t, t.textContent, t.getBoundingClientRect().width, box.clientWidth);
    }
    // display equations: the typeset SVG against the container, which is as wide as the
    // column (the container itself may clip or scroll what overflows)
    for (const c of document.querySelectorAll("mjx-container[display]")) {
      const svg = c.querySelector("svg");
      const content = Math.max(c.scrollWidth, svg ? svg.getBoundingClientRect().width : 0);
      wide("display equation", c, tex.get(c) || c.textContent, content, c.clientWidth);
    }
  } catch (e) {
    report.push("the width check failed in the page: " + e);
  }
  const out = document.createElement("script");
  out.type = "application/json";
  out.id = "check-offline-widths";
  out.textContent = JSON.stringify(report).replace(/</g, "\\\\u003c");
  document.body.appendChild(out);
})();
</script>
"""


UNRENDERED_TABLE = re.compile(r"<p>\|[^<]*\n\|\s*:?(-{3,}|\u2014)")  # (--- typeset as an em dash)


def browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("check_offline: no Chromium found (Debian: apt-get install chromium)")


def rendered_dom(exe, page):
    """The DOM of ``page`` after MathJax and the width check ran, from a copy of the page
    written beside it (so that its relative links resolve) and removed afterwards."""
    script = MEASURE % {"exempt": json.dumps(EXEMPT)}
    source = page.read_text()
    source = source.replace("</body>", script + "</body>", 1)
    with tempfile.NamedTemporaryFile("w", suffix=".html", prefix=".check-", dir=page.parent,
                                     delete=False) as f:
        f.write(source)
    copy = pathlib.Path(f.name)
    try:
        with tempfile.TemporaryDirectory() as profile:
            out = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                  "--dump-dom", copy.resolve().as_uri()],
                                 capture_output=True, text=True, timeout=180)
    finally:
        copy.unlink()
    return out.stdout


def main(html_dir):
    exe = browser()
    pages = sorted(pathlib.Path(html_dir).glob("*.html"))
    if not pages:
        sys.exit(f"check_offline: no pages under {html_dir}")
    failures = []
    for page in pages:
        source = page.read_text()
        if REMOTE_SCRIPT.search(source):
            failures.append(f"{page.name}: loads a script from the network")
            continue
        if "</body>" not in source:  # index.html: a redirect to the first page, no content
            continue
        # a markdown table printed by a cell: myst-nb renders it as CommonMark (no tables),
        # one paragraph of pipes (bookkit.show_table writes HTML instead)
        if UNRENDERED_TABLE.search(source):
            failures.append(f"{page.name}: a markdown table left unrendered (|---| in the page)")
        n_math = len(MATH.findall(source))
        dom = rendered_dom(exe, page)
        typeset = dom.count("<mjx-container")
        errors = dom.count("data-mjx-error")
        found = REPORT.search(dom)
        wide = json.loads(found.group(1)) if found else None
        status = ("ok" if typeset >= n_math and not errors and wide == [] else "FAIL")
        print(f"{page.name:32s} math {n_math:4d}  typeset offline {typeset:4d}  "
              f"errors {errors}  too wide {'?' if wide is None else len(wide)}  {status}")
        if typeset < n_math or errors:
            failures.append(f"{page.name}: {typeset} of {n_math} math elements typeset, "
                            f"{errors} errors")
        if wide is None:
            failures.append(f"{page.name}: the width check did not finish in the page")
        for w in wide or ():
            print(f"    too wide: {w}")
            failures.append(f"{page.name}: {w}")
    if failures:
        sys.exit("check_offline: " + str(len(failures)) + " failures:\n  "
                 + "\n  ".join(failures))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "book/_build/html")
