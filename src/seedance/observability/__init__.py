"""What operators see: Prometheus metrics (and, later, traces)."""
