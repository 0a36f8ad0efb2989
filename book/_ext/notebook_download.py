"""Each executed chapter downloadable as a notebook: the header's download menu gains
".ipynb" beside ".md" and ".pdf".

sphinx-book-theme offers the ``.ipynb`` of a MyST-markdown page only when a launch
button (Binder, Colab, ...) is configured, and none can work for this book yet (the
repository URL is a placeholder, and its chapters need the checkout beside them).  This
does the same copy without the launch button: myst-nb writes each executed notebook,
outputs included, to ``_build/jupyter_execute/<page>.ipynb``; it is copied beside the
page's sources and named in the page's context, where the theme's download menu looks.
"""

import shutil
from pathlib import Path


def add_notebook(app, pagename, templatename, context, doctree):
    if doctree is None or app.builder.format != "html":
        return
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if not executed.is_file():     # a page without code cells is not a notebook
        return
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(executed, target)
    context["ipynb_source"] = f"{pagename}.ipynb"


def setup(app):
    # before sphinx-book-theme's header buttons (priority 501), which read ipynb_source
    app.connect("html-page-context", add_notebook, priority=400)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
