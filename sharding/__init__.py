"""Sharding: read a corpus, train or load a tokenizer, route every document, write path shards."""
