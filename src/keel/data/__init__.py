"""Real text for benchmarks and evaluations, prepared once and cached on disk."""
