"""Steppers: how a trainer takes a step (local, pipelined, node), each over the same StepState (see .base)."""
