"""vLLM 0.32.0's own test suite (from its source distribution), run with this package
loaded."""
