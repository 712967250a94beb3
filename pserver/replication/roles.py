"""What a replica process does next, from what etcd says: a pure decision, table-tested.

=====================  ==============================  ===========
============================================ etcd's primary         etcd's in-sync list             this
process  decision =====================  ==============================  ===========
============================================ none                   absent (a fresh shard)          not
leading   CAMPAIGN: whoever comes first leads none                   lists this process              not
leading   CAMPAIGN: it holds every acknowledged update none                   lists others only, < timeout
not leading   WAIT for one of them to lead none                   lists others only, >= timeout   not
leading   RECOVER: lead from its checkpoint (trainers
                                                                     roll back to it, as without replicas)
another process        -                               joining       JOIN: copy its state, then follow it
another, epoch E       -                               following E   STAY, unless it was in the list and is
not
                                                                     any more (dropped): REJOIN
another, epoch != E    -                               following E   REJOIN: a new primary; copy its state
=====================  ==============================  ===========
============================================

The campaign itself is one etcd transaction (:mod:`.coordination`): two processes deciding CAMPAIGN at once
never both lead.
"""

from __future__ import annotations

from typing import Optional

PRIMARY, BACKUP, JOINING, FENCED = "primary", "backup", "joining", "fenced"
CAMPAIGN, RECOVER, WAIT, JOIN, STAY, REJOIN = "campaign", "recover", "wait", "join", "stay", "rejoin"


def next_step(
    role: str,
    leader,
    in_sync,
    me: str,
    following_epoch: int,
    was_in_sync: bool,
    waited: float,
    takeover_timeout: float,
) -> str:
    """The decision of the table above.

    ``leader`` and ``in_sync`` are etcd's records (:class:`~.coordination.Leader`,
    :class:`~.coordination.InSync`, None when absent); ``me`` this process's
    replica id; ``following_epoch`` the epoch of the primary it follows (0:
    none); ``was_in_sync`` whether it has been in the in-sync list since it
    started following; ``waited`` seconds since it found no primary it may replace.
    """
    if leader is None:
        if in_sync is None or me in in_sync.replicas:
            return CAMPAIGN
        return RECOVER if waited >= takeover_timeout else WAIT
    if leader.replica_id == me:
        return STAY
    if role != BACKUP:
        return JOIN
    if leader.epoch != following_epoch:
        return REJOIN
    listed: Optional[bool] = None if in_sync is None else me in in_sync.replicas
    if was_in_sync and listed is False:
        return REJOIN
    return STAY
