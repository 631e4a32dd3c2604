"""MkDocs build hook: the configuration reference is rendered from the schema at build time.

The committed docs/configuration.md is for readers of the repository; the site never serves a
stale copy of it (tests/test_docs.py checks that the committed one is current too).
"""

from laminar_mcore.config.reference import render

REFERENCE = "configuration.md"


def on_page_read_source(page, config):
    if page.file.src_uri == REFERENCE:
        return render()
    return None
