"""The documentation site: its API reference covers every public name, each with
the Google sections a reader looks for, the site builds in strict mode, and a
newcomer reaches the answer to each first question within one link of the README.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import docstrings
import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?\s*\)")


def test_every_public_name_has_a_complete_docstring() -> None:
    found = docstrings.problems()
    assert [str(p) for p in found] == [], f"{len(found)} gaps in the API reference's docstrings"


BAD_MODULE = '''
"""A module."""

from dataclasses import dataclass


class Thing:
    """A thing.

    Args:
        size: how big.
    """

    def __init__(self, size: int, colour: str) -> None:
        if size < 0:
            raise ValueError(size)
        self.size = size

    @property
    def area(self) -> int:
        return self.size**2

    def grow(self, by: int) -> int:
        """Grows.

        Args:
            by: how much.
        """
        if by < 0:
            raise ValueError(by)
        return self.size + by

    def shrink(self, by: int) -> int:
        """Shrinks.

        Args:
            by: how much.

        Returns:
            The new size.

        Raises:
            ValueError: when ``by`` is negative.
        """
        if by < 0:
            raise ValueError(by)
        if by > self.size:
            raise OverflowError(by)
        return self.size - by

    def fine(self, by: int) -> int:
        """Fine.

        Args:
            by: how much.

        Returns:
            The size.

        Raises:
            ValueError: when ``by`` is negative.
        """
        if by < 0:
            raise ValueError(by)
        return self.size

    def undocumented(self) -> None:
        pass

    def hidden(self) -> Hidden:
        """A value of a class the reference does not show.

        Returns:
            One.
        """
        return Hidden()

    def _private(self) -> None:
        pass


class Hidden:
    """Returned, but not rendered."""


@dataclass
class Record:
    """Fields are attributes, not constructor Args.

    Attributes:
        name: its name.
    """

    name: str
    size: int = 0
'''


def test_the_checker_finds_each_kind_of_gap(tmp_path: Path) -> None:
    """A checker that finds nothing would pass every docstring: show each gap it names."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""A package."""\n')
    (tmp_path / "pkg" / "mod.py").write_text(BAD_MODULE)
    package = docstrings.load(tmp_path, "pkg")
    found = [str(p) for p in docstrings.problems(package, ["pkg.mod.Thing", "pkg.mod.Record"])]
    assert found == [
        "pkg.mod.Record: Attributes: does not describe size",
        "pkg.mod.Thing.area: no docstring",
        "pkg.mod.Thing.grow: no Raises: section (raises ValueError)",
        "pkg.mod.Thing.grow: no Returns: section",
        "pkg.mod.Thing.hidden: returns pkg.mod.Hidden, not in docs/reference/",
        "pkg.mod.Thing.shrink: Raises: does not name OverflowError",
        "pkg.mod.Thing.undocumented: no docstring",
        "pkg.mod.Thing: Args: does not describe colour",
        "pkg.mod.Thing: Raises: does not name ValueError",
    ]


def test_the_reference_pages_render_every_target_that_exists() -> None:
    """A ``::: path`` to a moved name would render nothing; griffe must find each one."""
    package = docstrings.load()
    for path in docstrings.targets():
        assert docstrings.final(package[path.removeprefix("ckptdb.")]).path, path


@pytest.mark.timeout(240)
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """A broken link or anchor, a page missing from the navigation, a reference to a
    name that does not exist, or a docstring gap: each is a warning, and strict fails."""
    result = subprocess.run(
        # never -q: it hides the warnings that --strict counts, and the build passes
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "site" / "reference" / "manager" / "index.html").read_text("utf-8")
    assert "CheckpointManager" in api and "PublishError" in api
    assert re.findall(r":(?:class|meth|func|attr|mod):", api) == []  # roles shown as code
    changelog = tmp_path / "site" / "changelog" / "index.html"
    assert "Unreleased" in changelog.read_text("utf-8")


# ------------------------------------------------------------------- a newcomer

#: Each first question, the page that answers it, and text that page must hold.
QUESTIONS = {
    "how do I resume": ("docs/api.md", "resuming-a-run", 'load("latest")'),
    "what happens if the machine dies mid-save": (
        "docs/guarantees.md",
        "what-happens-if-the-machine-dies-mid-save",
        "power",
    ),
    "how do I find my best checkpoint from the shell": ("docs/cli.md", "ckptdb-best", "--by"),
    "what does save() raise": ("docs/reference/manager.md", "", "ckptdb.manager.CheckpointManager"),
}


def links_of(page: Path) -> set[str]:
    """The repository files (and anchors) a page links to, resolved from its folder."""
    text = re.sub(r"^```.*?^```", "", page.read_text("utf-8"), flags=re.M | re.S)
    found = set()
    for target in LINK.findall(text):
        if "://" in target or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve().relative_to(REPO).as_posix()
        found.add(f"{resolved}#{anchor}" if anchor else resolved)
    return found


@pytest.mark.parametrize("question", sorted(QUESTIONS))
def test_a_newcomer_finds_each_answer_within_one_link_of_the_readme(question: str) -> None:
    page, anchor, text = QUESTIONS[question]
    wanted = f"{page}#{anchor}" if anchor else page
    first = links_of(README)
    second = set().union(
        *(links_of(REPO / p.partition("#")[0]) for p in first if p.endswith(".md"))
    )
    reached = {link.partition("#")[0] if not anchor else link for link in first | second}
    assert wanted in reached, f"the README does not lead to {wanted} in one link"
    assert text in (REPO / page).read_text("utf-8"), f"{page} does not answer {question!r}"


def test_the_reference_says_what_save_raises() -> None:
    """The answer behind the README's last question, in the docstring the reference renders."""
    package = docstrings.load()
    save = package["manager.CheckpointManager.save"]
    raises = docstrings.sections(save.docstring).get("raises", set())
    assert {"PublishError", "NonFiniteGradientError", "InvalidArgumentError"} <= raises
