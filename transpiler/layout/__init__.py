"""Where a job's state lives, and how that changes: the routing of table ids to pservers
(:mod:`.routing`, versioned, moving little when pservers come and go)."""

from .routing import N_SLOTS, ROUTING_VERSION, jump_hash, owner_of, slot_of, slot_owners

__all__ = ["N_SLOTS", "ROUTING_VERSION", "jump_hash", "owner_of", "slot_of", "slot_owners"]
