"""Entry point kept for existing scripts: the service (python -m service; same as bert-knn serve)."""
