"""Tests of distributed tables: shards, files, lifecycle, disk tier, exports, sync equivalence."""
