"""Training data: the embedded corpus, byte batches, documents, tokenizers and token shards."""
