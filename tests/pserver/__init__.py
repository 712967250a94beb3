"""Tests of the pserver: engines, servicer, sessions, statuses, fuzzing, operators' views."""
