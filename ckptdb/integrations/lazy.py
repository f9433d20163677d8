"""A framework package's public names, imported from its writer module on first use.

Why: ``ckptdb adopt`` imports every framework package's layout (and so the
package) with none of the frameworks installed, while the writer (the
callback, the Trainer) must import its framework. A package therefore
defines its names as::

    if TYPE_CHECKING:
        from .callback import ModelCheckpoint
    else:
        __getattr__, __dir__ = lazy.names(__name__, "callback", __all__)

Type checkers see the real names (a misspelt one is an error); at run time
the writer is imported when a name is first used, and a missing framework
raises its ``ImportError`` there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

__all__ = ["names"]


def names(
    package: str, writer: str, public: Iterable[str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` (see the module docstring).

    Any attribute of the writer module resolves through the package (its
    public names and the rest, as when the package was one module); the
    package's own submodules never do, so importing ``package.layout`` does
    not import the writer.
    """
    listed = sorted(set(public))

    def __getattr__(name: str) -> object:
        if name.startswith("__") or name in (writer, "layout"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{writer}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        own = importlib.import_module(package).__dict__
        return sorted({*own, *listed})

    return __getattr__, __dir__
