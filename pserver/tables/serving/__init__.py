"""Exports of distributed tables for serving: a base, then deltas with tombstones.

- :mod:`.exports`: the on-disk format and its durable writer (done-files, pruning).
- :mod:`.exporter`: :class:`TableExporter`, a pserver's scheduled exports of its shards.
- :mod:`.reader`: the serving side, numpy only (loadable by path, without this package).
"""
