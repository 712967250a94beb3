"""Hot-standby replicas of a pserver shard (docs/recovery.md, "Hot standby").

- :mod:`.replica`: :class:`~.replica.Replica`, this process's place in its shard's replica set
  and the thread that keeps it (lead, follow, fence), built by the server with what it needs.
- :mod:`.roles`: what a replica does next, from what etcd says (a pure, table-tested decision);
  :mod:`.coordination` the coordinator's interface, :mod:`.etcd` its etcd implementation
  (:mod:`.etcd_gateway`: etcd's HTTP gateway and a transaction's parts).
- :mod:`.outbox`: the primary's replication stream (numbering, the backup's queue, acknowledgements);
  the engine hands it every change through its :class:`~pserver.engine.Replication` listener.
  :mod:`.backup`: the backup as its primary sees it (its states and queue), the messages of a change
  and the transport that sends them.
- :mod:`.follower`: the backup's side: the primary's messages applied in order.
- :mod:`.snapshot`: the copy of a primary's state a joining backup loads; :mod:`.digest`: the
  state digest both replicas compare.

The gRPC side (sending messages, fetching snapshots) is :mod:`pserver.rpc.replica_link`.
"""
