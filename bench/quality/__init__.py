"""The real-data quality benchmark: ``python -m bench.quality`` (corpus -> datastore -> LAMA, with and without retrieval)."""
