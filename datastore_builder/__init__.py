"""Entry point kept for existing scripts: the datastore builder (python -m datastore_builder; same as bert-knn build|add|validate|merge|ivfpq)."""
