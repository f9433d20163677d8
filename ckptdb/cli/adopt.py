"""The Python names of ``ckptdb adopt`` under the path earlier releases documented.

The library is :mod:`ckptdb.integrations.adopt` (``adopt``, ``AdoptReport``)
with the layouts' registry in :mod:`ckptdb.integrations.layouts`; this module
re-exports them so that ``from ckptdb.cli.adopt import adopt`` keeps working.
"""

from __future__ import annotations

from ..integrations.adopt import AdoptReport, adopt
from ..integrations.layouts import AliasChange, layout_named
from ..integrations.lightning.layout import stream_for_monitor as lightning_stream

__all__ = ["AdoptReport", "AliasChange", "adopt", "layout_named", "lightning_stream"]
