"""The services beside the engine: calls that wait for every live trainer, each under a lock of its own.

- :mod:`.reductions`: :class:`~.reductions.Reductions`, the Reduce service: trainers' global metrics
  combined on one pserver; it asks the engine which trainers it expects.
- :mod:`.claims`: :class:`~.claims.StepClaims`, backup trainers' Claim service on the first pserver
  (which trainers make each sync step), built the same way.

Both park their calls as the engine's own waits do (:mod:`pserver.engine.waits`) and share no lock with
the engine: it tells them when the trainers it expects may have changed.
"""
