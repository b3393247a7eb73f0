"""What the builder and the service share: the on-disk format, the embedding function, titles, words, errors."""
