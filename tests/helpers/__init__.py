"""Helpers shared by the tests: in-process clusters, models and data, fuzz cases, ports."""
