"""What the tests and the benchmarks share: ports, child processes, etcd, network namespaces, clusters.

Not part of the installed product: it is imported from the repository root, as ``tests`` and
``benchmarks`` are (pytest's rootdir on ``sys.path``, ``python -m benchmarks.x`` from the root, and
:func:`harness.paths.pythonpath_with_repo` for the processes they start). It imports neither ``tests``
nor ``benchmarks``, and ``benchmarks`` imports no ``tests`` (tests/test_layout.py checks both).
"""
