"""The trainer's side of the data channel (docs/dataplane.md): the connection to a pserver's data port
(:mod:`.data_channel`) and the payloads that travel on it (:mod:`.payloads`)."""
