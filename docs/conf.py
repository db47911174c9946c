"""Sphinx configuration of sandbox-kernel's documentation (MyST Markdown pages).

Build: ``.venv/bin/sphinx-build -W -n --keep-going -b html docs docs/_build/html``
(``.ci/test`` does). Everything is local: no intersphinx, nothing fetched, so the build
works offline once the ``docs`` extra is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "_ext"))

from sandbox_kernel._version import __version__  # noqa: E402

project = "sandbox-kernel"
author = "the sandbox-kernel maintainers"
copyright = "the sandbox-kernel maintainers"
version = release = __version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sandbox_config"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# The generated reference is included by reference/*.md, not a page of its own.
exclude_patterns = ["_build", "reference/generated"]
nitpicky = True

# `[text](page.md#a-heading)` links resolve to headings down to ###.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
autodoc_typehints = "none"

html_theme = "pydata_sphinx_theme"
html_title = f"sandbox-kernel {release}"
html_theme_options = {"navigation_depth": 2, "show_toc_level": 2}
html_show_sourcelink = False
