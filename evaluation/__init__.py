"""Entry point kept for existing scripts: the evaluation (python -m evaluation; same as bert-knn eval)."""
