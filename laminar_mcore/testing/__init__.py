"""Helpers for tests and benchmarks that start real processes (never mocks of our components)."""
