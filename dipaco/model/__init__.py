"""The model: the module grid (``grid.py``), a path's transformers model (``path_model.py``) and per-document
loss under it (``scoring.py``). No training, no files."""
