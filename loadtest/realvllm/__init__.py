"""Real vLLM (CPU build) replicas for end-to-end tests and benchmarks; see README.md."""
