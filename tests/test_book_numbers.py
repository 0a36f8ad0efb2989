"""Every number in the book's prose is computed, loaded from a committed results file, or
declared as a setting or a definition (book/check_numbers.py, which says how).

The first test runs the check on every page of the book; the others show that it can
fail: a number typed into a page's prose is caught, wherever in the prose it stands, and
numbers in code, math and roles (where computed numbers live) are not prose.
"""

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOK = os.path.join(ROOT, "book")

pytest.importorskip("markdown_it", reason="the check parses MyST as myst-parser does")
pytest.importorskip("mdit_py_plugins")


def load_check():
    spec = importlib.util.spec_from_file_location(
        "check_numbers", os.path.join(BOOK, "check_numbers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = load_check()
PAGE = "05_cpu_kernel.md"


def page_text(name=PAGE):
    with open(os.path.join(BOOK, name)) as f:
        return f.read()


def test_every_number_in_the_book_is_computed_loaded_or_declared():
    pages = check.pages()
    assert len(pages) >= 20, [p.name for p in pages]   # the check sees the whole book
    assert check.check() == []


def test_the_unchanged_page_passes():
    assert check.check_text(PAGE, page_text()) == []


@pytest.mark.parametrize("typed, where", [
    ("The forward took 17 ms into a fresh array.", "paragraph"),
    ("- the backward ran at 0.43x PyTorch's time", "list item"),
    ("## Streaming 1.33x faster", "heading"),
    ("| case | time |\n|---|---|\n| forward | 36.9 |", "table"),
    ("```{note}\nOn that machine the copy ran at 29 GB/s.\n```", "admonition"),
    ("Its ratio moved between 1.30x and 1.44x, *12 ms* of it page faults.", "emphasis"),
])
def test_a_number_typed_into_the_prose_is_caught(typed, where):
    text = page_text()
    anchor = "## What to remember"
    assert anchor in text
    findings = check.check_text(PAGE, text.replace(anchor, typed + "\n\n" + anchor, 1))
    numbers = set(re.findall(r"\d+(?:\.\d+)?", typed)) - {"1"}
    caught = {n for n in numbers if any(f"'{n}" in f for f in findings)}
    assert caught == numbers, (where, findings)


def test_a_number_beside_a_declared_phrase_is_still_caught():
    # "a 4096 x 1024 float32 problem" is declared for this page; a number elsewhere in
    # the same sentence is not covered by it
    text = page_text().replace("a 4096 x 1024 float32 problem",
                               "a 4096 x 1024 float32 problem, in 4.2 ms,", 1)
    findings = check.check_text(PAGE, text)
    assert len(findings) == 1 and "'4.2'" in findings[0], findings


@pytest.mark.parametrize("fine", [
    "```{code-cell} ipython3\nprint(17.5, 'ms')\n```",                # code
    "The time, `17 ms`, in code.",                                    # inline code
    "A bound, $10^4$ and $2^{-10}$, in math.",                        # math
    "$$\nt = 17.5\n$$",                                               # display math
    "It took {glue:text}`t_ms` ms ({ref}`ch-numerics`).",            # a computed number
    "float32, float16, bfloat16, sm_90, x86-64, AVX-512 and L2 are names.",
    "See chapter 4 and chapters 5 to 9.",                             # structure
])
def test_code_math_roles_and_names_are_not_prose_numbers(fine):
    text = page_text().replace("## What to remember", fine + "\n\n## What to remember", 1)
    assert check.check_text(PAGE, text) == []


def test_a_stale_declaration_is_an_error():
    text = page_text().replace("a 4096 x 1024 float32 problem", "a small float32 problem", 1)
    findings = check.check_text(PAGE, text)
    assert any("no longer occurs" in f and "4096 x 1024" in f for f in findings), findings


def test_a_measurement_cannot_be_declared_a_setting():
    own = check.DECLARED[PAGE] + [("took 17 ms", "setting", "a typed time")]
    text = page_text().replace("## What to remember", "It took 17 ms.\n\n## What to remember", 1)
    findings = check.check_text(PAGE, text, own)
    assert any("states a measurement" in f for f in findings), findings
