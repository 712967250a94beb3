"""A running job's layout and its changes (issue 51): the phases of a change as pure transitions of the
job's record (:mod:`transpiler.layout.record`: :mod:`.phases`), the stores that keep the record by
compare-and-set (:mod:`.stores`: a file under ``checkpoint_dir``, or etcd), a pserver's part in a change
(:mod:`.switch`), the layout a pserver process starts in (:mod:`.joining`), ``ps-reshard``
(:mod:`.reshard_cli`), and the moves of state between live pservers (:mod:`.slot_moves`,
:mod:`.block_moves`)."""

from transpiler.layout.record import LayoutChange, LayoutRecord

from .stores import EtcdLayoutStore, FileLayoutStore, LayoutStore, StaleRecord, update

__all__ = [
    "EtcdLayoutStore",
    "FileLayoutStore",
    "LayoutChange",
    "LayoutRecord",
    "LayoutStore",
    "StaleRecord",
    "update",
]
