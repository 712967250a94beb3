"""The benchmark harness: entry points run from the repository root as ``python -m benchmarks.<name>``.

``benchmarks/README.md`` lists them; ``jobs/`` holds the processes they start, ``common/`` the
helpers they share, ``results/`` what they recorded.
"""
