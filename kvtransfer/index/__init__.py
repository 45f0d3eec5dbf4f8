"""Block-hash index: which nodes hold which KV blocks (see DESIGN.md, "Block-hash index")."""

from __future__ import annotations

from tandem.kvtransfer.index.base import BlockIndex, get_index

__all__ = ["BlockIndex", "get_index"]
