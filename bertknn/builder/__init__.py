"""The datastore builder: corpus -> masked contexts -> embeddings -> shards and article indexes (offline)."""
