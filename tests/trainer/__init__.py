"""Tests of the trainer: feed, steppers, nodes, collective mode, AMP, CUDA."""
