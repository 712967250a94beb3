"""The data path: the data channel's server side (listener, reactors) and the calls it serves.

Pushes, pulls and prefetches travel over the data channel (:mod:`psproto.dataplane.frames`,
:mod:`psproto.dataplane.payload`; docs/dataplane.md); gRPC keeps the control. :mod:`.listener` accepts and
authenticates connections, :mod:`.reactor` serves them without a thread per waiting call.
"""
