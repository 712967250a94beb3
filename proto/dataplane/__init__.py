"""The data channel's wire (version 1): frames (:mod:`.frames`), payload layouts (:mod:`.payload`), and its
access control (:mod:`.access`: the gRPC port's token and TLS, for plain sockets). docs/dataplane.md."""
