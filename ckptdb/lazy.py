"""A package's public names, each imported from its module on first use (PEP 562).

Why: reading a ledger (``RunReader``, ``ckptdb latest``) needs SQLAlchemy and
nothing of torch, whose import alone takes about 1.5 s; a package that
imported every public name eagerly would make every cold ``ckptdb latest``
pay for it. A package defines its names as::

    if TYPE_CHECKING:
        from .reader import RunReader
    else:
        __getattr__, __dir__ = lazy.attributes(__name__, {"RunReader": ".reader"})

Type checkers see the real names; at run time a name's module is imported
when the name is first used, and the value is then kept in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["attributes"]


def attributes(
    package: str, where: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: ``where`` maps each
    public name to its module, relative to ``package`` (``".reader"``)."""

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:  # a submodule too: ``from package import sub`` then imports it
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # once: later reads are plain lookups
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
