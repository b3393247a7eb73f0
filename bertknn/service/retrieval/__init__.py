"""Article retrieval (subject rule, BM25, TF-IDF) and kNN search (restricted to articles, or whole-datastore)."""
