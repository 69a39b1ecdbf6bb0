"""A run: its directory's lifecycle while it trains (``RunDirectory``: resume checks, creation, round 0), and the
trained directory read back (``Run``). Which trainee trains what is training's (``dipaco.training.plan``).

    RUN/config.toml     the resolved training config
    RUN/run.json        grid, vocabulary, the shard directory's fingerprint, trainees, versions
    RUN/metrics.jsonl   one JSON object per line (inner-step losses, round summaries)
    RUN/checkpoints/    see dipaco.storage.checkpoint
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

import dipaco
from dipaco.config import TrainConfig, from_dict, read_toml, to_dict, to_toml
from dipaco.errors import DipacoError
from dipaco.io import atomic_write_text, read_json, write_json
from dipaco.model.grid import Grid, format_grid
from dipaco.model.path_model import PathModel, count_parameters, init_modules, llama_config
from dipaco.storage import checkpoint
from dipaco.storage.shards import ShardSet

if TYPE_CHECKING:  # a type only: training imports storage, never the other way
    from dipaco.training.plan import Plan


def build_grid(cfg: TrainConfig, shape: str) -> Grid:
    g = cfg.grid
    return Grid.build(shape, cfg.model.num_layers, g.level_sizes, g.private_blocks, g.private_embedding, g.private_head)


# ------------------------------------------------------------------------------ the run directory's lifecycle
# inner_steps too: a round's global steps (r·H + 1 ...) and the trainees' step counters must keep lining up
_COMPATIBLE_SECTIONS = ("model", "grid", "inner", "outer", "streaming", "seed", "inner_steps")


class RunDirectory:
    """The run directory of a training: checked (new, or resumable with --resume), created, and begun on
    every worker (``begin``: the latest round restored, or round 0 written)."""

    def __init__(self, root: str | Path, cfg: TrainConfig, shards: ShardSet):
        self.root, self.cfg, self.shards = Path(root), cfg, shards

    def check(self, resume: bool) -> int:
        """The round the run would start from, or the error that says why it cannot (no side effects)."""
        run_dir, cfg, shards = self.root, self.cfg, self.shards
        latest = checkpoint.latest_round(run_dir) if run_dir.exists() else None
        if latest is not None and not resume:
            raise DipacoError(f"{run_dir} already holds a run (round {latest}); pass --resume to continue it or choose another --out")
        if latest is None:
            return 0
        old = to_dict(from_dict(TrainConfig, read_toml(run_dir / "config.toml")))
        new = to_dict(cfg)
        for key in _COMPATIBLE_SECTIONS:
            if old[key] != new[key]:
                raise DipacoError(f"cannot resume {run_dir}: its config '{key}' differs from the one given; "
                                  f"resume with the run's own config ({run_dir / 'config.toml'}) or train into a new --out")
        info = read_json(run_dir / "run.json", "run description")
        if info["shards_fingerprint"] != shards.fingerprint:
            raise DipacoError(f"cannot resume {run_dir}: it was trained on other shards ({info['shards_dir']}); pass those --shards")
        return latest

    def schedule_steps(self) -> int:
        """The lr schedule's length in inner steps, fixed when the run was created (run.json). Extending a run with
        --resume and more --rounds does not stretch the cosine: the extra steps run at the final lr."""
        return int(read_json(self.root / "run.json", "run description")["schedule_steps"])

    def create(self, grid: Grid, plan: Plan, workers: int, parameters: dict[str, int]) -> None:
        """config.toml and run.json; a metrics.jsonl left by an attempt that never wrote round 0 is dropped."""
        cfg, shards = self.cfg, self.shards
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.root / "config.toml", to_toml(cfg))
        write_json(self.root / "run.json", {
            "grid": format_grid(grid.shape), "grid_detail": grid.describe(), "vocab_size": shards.vocab_size,
            "eos_token_id": shards.eos_token_id, "shards_dir": str(shards.root.resolve()),
            "shards_fingerprint": shards.fingerprint, "shards_grid": shards.grid,
            "tokenizer_sha256": shards.manifest["tokenizer"]["sha256"],
            "trainees": [{"path": p, "sources": s, "tokens": n, "worker": r}
                         for (p, s), n, r in zip(plan.trainees, plan.sizes, plan.ranks)],
            "workers": workers,
            "schedule_steps": cfg.rounds * cfg.inner_steps,  # the lr schedule's length, kept when a run is extended
            "parameters": parameters,
            "versions": {"dipaco": dipaco.__version__, "torch": torch.__version__}})
        (self.root / "metrics.jsonl").unlink(missing_ok=True)

    def begin(self, resume: bool, world, grid: Grid, plan: Plan, worker, checkpointer: checkpoint.Checkpointer) -> tuple[int, int]:
        """On every worker: rank 0 checks the directory (resume: drops half-written rounds) or creates it, and every
        rank learns the round to start from and the lr schedule's length (or the error). A resumed ``worker``
        (``dipaco.training.train.Worker``) restores its part of that round; a new run writes round 0."""
        result = None
        if world.rank == 0:
            try:
                start = self.check(resume)
                if start:
                    checkpoint.remove_partial_rounds(self.root)
                else:
                    self.create(grid, plan, world.size, worker.parameters)
                result = (start, self.schedule_steps())
            except DipacoError as exc:
                result = exc
        result = world.broadcast(result if world.rank == 0 else None)
        if isinstance(result, DipacoError):
            raise DipacoError(str(result))
        start, schedule = result
        worker.start(checkpointer.load(start, list(worker.modules), [tr.index for tr in worker.trainees]) if start else None)
        if start == 0:
            checkpointer.save(0, worker.part())
        return start, schedule


# ------------------------------------------------------------------------------ a run read back


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


def initial_modules(cfg: TrainConfig, grid: Grid, shards: ShardSet, first_path: str,
                    keep: set[str] | None = None) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """Round 0's global weights of the modules in ``keep`` (all when None): every module from one seeded dense model,
    or, with ``cfg.init_from``, from that dense run's weights; and the parameter counts of run.json (``total``: every
    module, ``per_path``: the modules of ``first_path``)."""
    every = init_modules(grid, llama_config(cfg.model, shards.vocab_size, shards.eos_token_id), cfg.seed)
    counts = {"total": count_parameters(every), "per_path": count_parameters(every, grid.path_modules(first_path))}
    modules = every if keep is None else {m: t for m, t in every.items() if m in keep}
    if cfg.init_from:
        init_from_dense(modules, cfg.init_from, shards)
    return modules, counts
