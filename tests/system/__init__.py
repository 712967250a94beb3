"""Tests of system tests: Slurm, network namespaces (real TCP), partitions."""
