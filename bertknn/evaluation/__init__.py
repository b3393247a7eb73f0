"""LAMA evaluation of the BERT-kNN pipeline: probe readers, query construction, metrics, runners, grid search."""
