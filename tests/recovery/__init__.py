"""Tests of faults, checkpoints and recovery: pure decisions, then killed processes."""
