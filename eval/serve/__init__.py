"""``dipaco serve``: a trained run behind OpenAI's HTTP API, routed, batched by path, its modules held once.

modules.py (resident modules and the paths assembled on them), batcher.py (continuous batching by path),
engine.py (a served run: routing and jobs), choices.py (one choice of an answer), api.py (OpenAI's shapes),
app.py (the HTTP server), upstream.py (the front router), metrics.py (Prometheus text). docs/serving.md tells the
whole story.
"""
