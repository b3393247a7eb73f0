"""BERT-kNN: cloze question answering with a masked LM and nearest neighbours over an embedded Wikipedia."""
