"""Tests of the transpiler: slicing, placement, plans, roles from the environment."""
