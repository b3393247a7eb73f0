"""The online BERT-kNN answerer: FastAPI app over a datastore built by `datastore_builder`."""
