"""Where a job's state lives, and how that changes: the routing of table ids to pservers
(:mod:`.routing`, versioned, moving little when pservers come and go), a change's checks
(:mod:`.change_checks`), the record (:mod:`.record`) and the next layout's plans (:mod:`.change`). The
routing's names are imported on first use, so the record and the checks load without torch
(``ps-reshard``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        name: ".routing"
        for name in ("N_SLOTS", "ROUTING_VERSION", "jump_hash", "owner_of", "slot_of", "slot_owners")
    },
)
__all__ = ["N_SLOTS", "ROUTING_VERSION", "jump_hash", "owner_of", "slot_of", "slot_owners"]

if TYPE_CHECKING:
    from .routing import N_SLOTS, ROUTING_VERSION, jump_hash, owner_of, slot_of, slot_owners
