"""Helpers only the benchmarks share: the machine's load, the results and the peers' paths, the peers'
runs, the dense job's runs. What they share with the tests (child processes, ports, etcd, network
namespaces) is in ``harness/``."""
