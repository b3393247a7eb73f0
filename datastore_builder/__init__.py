"""Offline job: corpus -> masked-context embeddings -> memory-mappable datastore shards keyed by article."""
