"""MkDocs hooks (mkdocs.yml ``hooks:``): what the site needs beyond docs/ itself.

- Every gap that tests/docstrings.py finds in a public name's docstring is a
  warning, so ``mkdocs build --strict`` fails on a missing docstring or an
  undocumented argument, as the API reference promises.
- CHANGELOG.md lives at the repository root (where Keep a Changelog puts it and
  where GitHub shows it); the site gets it as the page ``changelog.md``, and a
  page's link to ``../CHANGELOG.md`` becomes a link to that page.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import griffe

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHANGELOG = REPO / "CHANGELOG.md"
TO_CHANGELOG = re.compile(r"\]\((?:\.\./)+CHANGELOG\.md(#[^)]*)?\)")

log = logging.getLogger("mkdocs.plugins.ckptdb")


def on_pre_build(config: Any) -> None:
    sys.path.insert(0, str(HERE))
    try:
        import docstrings
    finally:
        sys.path.remove(str(HERE))
    for problem in docstrings.problems():
        log.warning("docstring: %s", problem)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    content = CHANGELOG.read_text("utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "changelog.md", content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    depth = page.file.src_uri.count("/")
    target = "../" * depth + "changelog.md"
    return TO_CHANGELOG.sub(lambda m: f"]({target}{m.group(1) or ''})", markdown)


SPHINX_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj|const):`~?\.?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """A griffe extension (mkdocs.yml: ``extensions``): the docstrings name code with
    Sphinx roles (``:class:`Checkpoint```), which help() and editors show as they are;
    Markdown would print the role, so the site shows the name as code instead."""

    def on_object(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = SPHINX_ROLE.sub(r"`\1`", obj.docstring.value)
