"""A trained run directory, read back: its config, grid, and any path's model at any round.

    RUN/config.toml     the resolved training config
    RUN/run.json        grid, vocabulary, the shard directory's fingerprint, trainees, versions
    RUN/metrics.jsonl   one JSON object per line (inner-step losses, round summaries)
    RUN/checkpoints/    see dipaco.checkpoint
"""

from __future__ import annotations

from pathlib import Path

from dipaco import checkpoint
from dipaco.config import TrainConfig, from_dict, read_toml
from dipaco.errors import DipacoError
from dipaco.grid import Grid
from dipaco.io import read_json
from dipaco.model import PathModel, llama_config


def build_grid(cfg: TrainConfig, shape: str) -> Grid:
    g = cfg.grid
    return Grid.build(shape, cfg.model.num_layers, g.level_sizes, g.private_blocks, g.private_embedding, g.private_head)


class Run:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not (self.root / "run.json").is_file():
            raise DipacoError(f"{self.root} is not a dipaco run directory (no run.json); train one with `dipaco train`")
        self.info = read_json(self.root / "run.json", "run description")
        self.config: TrainConfig = from_dict(TrainConfig, read_toml(self.root / "config.toml"))
        self.grid = build_grid(self.config, self.info["grid"])
        self.llama_config = llama_config(self.config.model, self.info["vocab_size"], self.info["eos_token_id"])

    @property
    def rounds(self) -> list[int]:
        return checkpoint.list_rounds(self.root)

    def latest(self) -> int:
        r = checkpoint.latest_round(self.root)
        if r is None:
            raise DipacoError(f"run {self.root} has no checkpoint yet; train it first")
        return r

    @property
    def is_dense(self) -> bool:
        return self.grid.num_paths == 1

    def path_model(self, path: str, round: int | None = None) -> PathModel:
        """Load only the modules of ``path`` (a dense run has the single path '0')."""
        r = self.latest() if round is None else round
        if r not in self.rounds:
            raise DipacoError(f"run {self.root} has no round {r}; available: {self.rounds}")
        model = PathModel(self.grid, path, self.llama_config)
        model.load_modules(checkpoint.load_modules(self.root, r, model.modules))
        model.model.eval()
        return model


def _tokenizer_model(directory: Path) -> dict | None:
    """The vocabulary and merges of a Hugging Face fast tokenizer directory (None when it has none)."""
    f = directory / "tokenizer.json"
    if not f.is_file():
        return None
    return read_json(f, "tokenizer").get("model")


def _check_tokenizer(src: Path, same: bool, shards_dir, tokenizer_dir) -> None:
    if not same:
        raise DipacoError(f"--init-from {src} was trained with another tokenizer than --shards {shards_dir} "
                          f"(its token ids mean other strings); re-shard with --tokenizer {tokenizer_dir}")


def check_dense_source(source: str | Path, shards=None) -> "Run | None":
    """Check an --init-from source without loading its weights: a dense dipaco run (returned) or a Hugging
    Face directory (None); with ``shards`` (the ShardSet being trained on) its tokenizer must be theirs."""
    src = Path(source)
    if (src / "run.json").is_file():
        run = Run(src)
        if not run.is_dense:
            raise DipacoError(f"--init-from {src}: run has grid {run.info['grid']}, not a dense model; "
                              f"pass a run trained with --grid 1 or a Hugging Face Llama directory")
        if shards is not None:
            _check_tokenizer(src, run.info.get("tokenizer_sha256") == shards.manifest["tokenizer"]["sha256"],
                             shards.root, Path(run.info.get("shards_dir", "SHARDS")) / "tokenizer")
        return run
    if (src / "config.json").is_file():
        theirs = _tokenizer_model(src)
        if shards is not None and theirs is not None:
            _check_tokenizer(src, theirs == _tokenizer_model(shards.root / "tokenizer"), shards.root, src)
        return None
    raise DipacoError(f"--init-from {src}: neither a dipaco run (run.json) nor a Hugging Face directory (config.json); "
                      f"pass one of those")


def dense_weights(source: str | Path, shards=None) -> dict:
    """Parameters of a dense model to start every module from: a dipaco '--grid 1' run (its latest
    round) or a Hugging Face Llama directory. Keyed by Hugging Face parameter names. With ``shards``
    (the ShardSet being trained on) the source's tokenizer must be the shards' tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    src = Path(source)
    run = check_dense_source(src, shards)
    if run is not None:
        model = run.path_model(run.grid.paths[0])
        return {n: p.detach().float() for n, p in model.model.named_parameters()}
    try:  # safetensors only: a pickled checkpoint (pytorch_model.bin) is never loaded
        model = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32, use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise DipacoError(f"--init-from {src}: not a loadable Hugging Face Llama directory "
                          f"({(str(exc).splitlines() or [''])[0][:300]}); "
                          f"pass a directory with config.json and model weights") from None
    return {n: p.detach().float() for n, p in model.named_parameters()}


def init_from_dense(modules: dict, source: str | Path, shards=None) -> None:
    """Overwrite every module's tensors, in place, with the dense model's tensors of the same name."""
    dense = dense_weights(source, shards)
    for m, tensors in modules.items():
        for n, t in tensors.items():
            if n not in dense:
                raise DipacoError(f"--init-from {source}: it has no parameter {n} (module {m}); "
                                  f"the dense model must have the same layers and embedding tying as this run")
            if tuple(dense[n].shape) != tuple(t.shape):
                raise DipacoError(f"--init-from {source}: {n} has shape {tuple(dense[n].shape)}, this run needs "
                                  f"{tuple(t.shape)}; use the same model config and tokenizer as the dense model")
            t.copy_(dense[n])
