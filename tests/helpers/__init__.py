"""Helpers shared by the tests: jobs of real processes, fuzz cases, table models, the system tests' skips.

What the tests share with the benchmarks (ports, child processes, etcd, network namespaces, the
in-process cluster, the odd-sized MLP) is in ``harness/``.
"""
