"""A running job's layout and its changes (issue 51): the record of the layout epoch and the change in
progress (:mod:`.record`), the phases of a change as pure transitions (:mod:`.phases`), and the stores
that keep the record by compare-and-set (:mod:`.stores`: a file under ``checkpoint_dir``, or etcd)."""

from transpiler.layout.record import LayoutChange, LayoutRecord

from .phases import GO_ON, ROLL_BACK
from .stores import EtcdLayoutStore, FileLayoutStore, LayoutStore, StaleRecord, update

__all__ = [
    "GO_ON",
    "ROLL_BACK",
    "EtcdLayoutStore",
    "FileLayoutStore",
    "LayoutChange",
    "LayoutRecord",
    "LayoutStore",
    "StaleRecord",
    "update",
]
