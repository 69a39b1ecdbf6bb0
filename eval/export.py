"""Export one path as a plain Hugging Face directory (model + tokenizer, no dipaco needed to load it).

The path model already is a ``LlamaForCausalLM`` keyed by Hugging Face parameter names, so the
export is ``save_pretrained`` of the assembled path plus the shards' tokenizer, written under a
temporary name and renamed into place.
"""

from __future__ import annotations

from pathlib import Path

import dipaco
from dipaco.io import write_json
from dipaco.storage.outputs import atomic_dir


def export_path(rr, path: str, out: str | Path, round: int | None = None, overwrite: bool = False) -> Path:
    """Write ``out`` so that AutoModelForCausalLM / AutoTokenizer.from_pretrained(out) load the path."""
    r = rr.run.latest() if round is None else round
    model = rr.path_model(path, r).model
    out = Path(out)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.generation_config.pad_token_id = rr.run.info["eos_token_id"]
        model.save_pretrained(tmp, safe_serialization=True)
        rr.tokenizer.save_pretrained(tmp)
        loaded, total = rr.bytes_of([path], r)
        write_json(tmp / "dipaco_export.json", {
            "run": str(rr.run.root.resolve()), "path": path, "round": r, "grid": rr.run.info["grid"],
            "modules": rr.run.grid.path_modules(path), "module_bytes": loaded, "all_module_bytes": total,
            "shards": str(rr.shards.root.resolve()), "dipaco_version": dipaco.__version__})
    return out
