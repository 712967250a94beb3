"""Scripts the tests run as separate processes (every role of a job, a pserver that crashes)."""
