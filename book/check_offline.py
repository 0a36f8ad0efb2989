"""Check that the built book renders its math with no network.

    python book/check_offline.py book/_build/html

Every page must load its scripts from the book itself (no ``<script src="http...">``),
and, opened in headless Chromium with every host name unresolvable, every math
element of the page must have become a MathJax ``mjx-container`` (raw TeX is what
a reader without network would otherwise see).  Exits non-zero naming the pages
that fail.
"""

import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no host resolves: the page is offline
    "--virtual-time-budget=20000",            # let MathJax typeset before the DOM dump
]
REMOTE_SCRIPT = re.compile(r'<script[^>]+src="(https?:)?//', re.I)
MATH = re.compile(r'class="[^"]*\bmath\b[^"]*"')


def browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("check_offline: no Chromium found (Debian: apt-get install chromium)")


def rendered_dom(exe, page):
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                              page.resolve().as_uri()],
                             capture_output=True, text=True, timeout=180)
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
        n_math = len(MATH.findall(source))
        if not n_math:
            continue
        dom = rendered_dom(exe, page)
        typeset = dom.count("<mjx-container")
        errors = dom.count("data-mjx-error")
        status = "ok" if typeset >= n_math and not errors else "FAIL"
        print(f"{page.name:32s} math {n_math:4d}  typeset offline {typeset:4d}  errors {errors}  {status}")
        if status != "ok":
            failures.append(f"{page.name}: {typeset} of {n_math} math elements typeset, {errors} errors")
    if failures:
        sys.exit("check_offline: " + "; ".join(failures))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "book/_build/html")
