"""The processes the benchmarks start: roles of a job (ps-launch runs a script per role) and worker
processes."""
