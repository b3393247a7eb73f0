"""Helpers the tests share (and the benchmarks borrow): real processes, never mocks."""
