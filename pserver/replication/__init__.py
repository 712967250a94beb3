"""Hot-standby replicas of a pserver shard (README "Hot standby")."""
