"""Evaluation: routed perplexity on held-out documents, reports."""
