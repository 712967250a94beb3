"""Helpers the benchmarks share: child processes, ports, the machine's load, etcd, network namespaces,
reports."""
