"""What the benchmarks print and record: one module per benchmark's tables and summaries (pure functions of
its runs)."""
