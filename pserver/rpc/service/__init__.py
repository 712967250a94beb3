"""The ParameterServer service: :class:`~.servicer.PserverServicer`, composed of one servicer per concern.

``servicer.py`` builds and registers them; ``data_calls.py`` answers pushes, pulls and prefetches;
``control_calls.py`` a trainer's session, its orders to the pserver and its rounds with the other
trainers (and Stats); ``standby_calls.py`` hot standby's calls between a shard's two processes.
"""

from .servicer import PserverServicer

__all__ = ["PserverServicer"]
