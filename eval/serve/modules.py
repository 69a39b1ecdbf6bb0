"""Resident modules and the paths assembled from them.

A path's model is a ``LlamaForCausalLM`` whose parameters *are* the resident module tensors (assigned, not copied):
two paths that share a module share its memory. Modules are loaded on demand and leave by least recent use when the
resident bytes would pass the budget; a module of a path that has work in flight is pinned and never leaves.

``ModuleSource`` says where module tensors come from: a dipaco run's checkpoint round (``RunModules``), or a plain
Hugging Face directory served as a single path (``HFModules``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from dipaco.errors import DipacoError


class RunModules:
    """Module tensors of one checkpoint round of a dipaco run."""

    def __init__(self, run, round: int | None = None):
        from dipaco.storage import checkpoint

        self.run, self._checkpoint = run, checkpoint
        self.round = run.latest() if round is None else round
        if self.round not in run.rounds:
            raise DipacoError(f"run {run.root} has no round {self.round}; available: {run.rounds}")
        self.paths = run.grid.paths
        self.config = run.llama_config
        folder = checkpoint.round_dir(run.root, self.round) / "modules"
        self.path_modules = {p: run.grid.path_modules(p) for p in self.paths}
        self.nbytes = {m: (folder / f"{m}.safetensors").stat().st_size for ms in self.path_modules.values() for m in ms}

    def load(self, module: str) -> dict[str, torch.Tensor]:
        return self._checkpoint.load_modules(self.run.root, self.round, [module])[module]


class HFModules:
    """A plain Hugging Face causal-LM directory, served as one path named ``path`` made of one module."""

    def __init__(self, directory: str | Path, path: str = "0"):
        from transformers import AutoConfig

        self.directory = Path(directory)
        if not (self.directory / "config.json").is_file():
            raise DipacoError(f"--model {self.directory}: not a Hugging Face model directory (no config.json); "
                              f"export one with `dipaco export`")
        self.config = AutoConfig.from_pretrained(self.directory)
        self.paths = [path]
        self.path_modules = {path: ["model"]}
        self.nbytes = {"model": sum(f.stat().st_size for f in self.directory.glob("*.safetensors"))
                       or sum(f.stat().st_size for f in self.directory.glob("*.bin"))}

    def load(self, module: str) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForCausalLM

        try:  # safetensors only: a pickled checkpoint is never loaded
            model = AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.float32, use_safetensors=True)
        except (OSError, ValueError) as exc:
            raise DipacoError(f"--model {self.directory}: cannot load it ({(str(exc).splitlines() or [''])[0][:200]}); "
                              f"pass a directory with config.json and safetensors weights") from None
        return {n: p.detach() for n, p in model.named_parameters()}


def assemble(config, tensors: dict[str, torch.Tensor]):
    """A causal LM whose parameters are ``tensors`` themselves (no copy): built on the meta device, then assigned.
    Non-persistent buffers (rotary frequencies) are not in a checkpoint, so the rotary module is built for real."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise DipacoError(f"the path's modules do not make a whole model (missing {sorted(set(missing) - tied)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}); the checkpoint does not match its run's config")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    base = model.base_model
    if hasattr(base, "rotary_emb"):
        base.rotary_emb = type(base.rotary_emb)(config=config)
    model.generation_config.pad_token_id = config.eos_token_id
    return model.eval()


class ModuleCache:
    """Resident modules under a byte budget, least recently used first out, and the path models built on them.

    Thread-safe: the batcher asks for models and pins paths; a loader thread brings cold paths in."""

    def __init__(self, source, budget: int, metrics=None):
        self.source, self.budget, self.metrics = source, int(budget), metrics
        largest = max(sum(source.nbytes[m] for m in ms) for ms in source.path_modules.values())
        if largest > self.budget:
            raise DipacoError(f"--max-memory {self.budget:,} bytes is smaller than one path ({largest:,} bytes of "
                              f"modules); raise it to at least {largest:,}")
        self.modules: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()  # oldest use first
        self.models: dict[str, object] = {}
        self.pins: dict[str, int] = {}  # path -> requests in flight
        self.lock = threading.RLock()
        self.loaded = threading.Condition(self.lock)
        self.loading: set[str] = set()

    # ------------------------------------------------------------------ state
    @property
    def resident_bytes(self) -> int:
        with self.lock:
            return sum(self.source.nbytes[m] for m in self.modules)

    def parameter_bytes(self) -> int:
        """Bytes of the distinct tensors behind every resident path model's parameters, counted by storage: what the
        paths really hold, shared modules once."""
        with self.lock:
            seen = {}
            for model in self.models.values():
                for p in model.parameters():
                    seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
            return sum(seen.values())

    def pin(self, path: str, n: int = 1) -> None:
        with self.lock:
            self.pins[path] = self.pins.get(path, 0) + n
            if self.pins[path] <= 0:
                del self.pins[path]

    def _pinned_modules(self) -> set[str]:
        return {m for p in self.pins for m in self.source.path_modules[p]}

    # ------------------------------------------------------------------ use
    def model(self, path: str):
        """The resident model of ``path`` (None when cold); marks its modules as just used."""
        with self.lock:
            model = self.models.get(path)
            if model is not None:
                for m in self.source.path_modules[path]:
                    self.modules.move_to_end(m)
            return model

    def load(self, path: str, pin: bool = False):
        """Bring ``path`` in (loading only its missing modules, evicting others first); returns its model, or None when
        it cannot fit now because pinned paths hold the memory (the caller retries after requests finish). With
        ``pin`` the path is pinned as it becomes resident, so nothing evicts it before its requests start."""
        with self.lock:
            while path in self.loading:  # another thread loads it: wait for that
                self.loaded.wait()
            if path in self.models:
                if pin:
                    self.pin(path)
                return self.model(path)
            needed = [m for m in self.source.path_modules[path] if m not in self.modules]
            if not self._make_room(sum(self.source.nbytes[m] for m in needed), keep=set(self.source.path_modules[path])):
                return None
            self.loading.add(path)
        try:
            started = time.perf_counter()
            fresh = {m: self.source.load(m) for m in needed}  # outside the lock: others keep being answered
            seconds = time.perf_counter() - started
        except BaseException:
            with self.lock:
                self.loading.discard(path)
                self.loaded.notify_all()
            raise
        with self.lock:
            self.modules.update(fresh)
            tensors = {n: t for m in self.source.path_modules[path] for n, t in self.modules[m].items()}
            self.models[path] = assemble(self.source.config, tensors)
            if pin:
                self.pin(path)
            self.loading.discard(path)
            self.loaded.notify_all()
            if self.metrics is not None:
                self.metrics.module_loads(len(fresh), sum(self.source.nbytes[m] for m in fresh), seconds)
            return self.model(path)

    def _make_room(self, nbytes: int, keep: set[str]) -> bool:
        """Evict least recently used modules (never pinned ones, nor ``keep``) until ``nbytes`` more fit."""
        protected = self._pinned_modules() | keep | {m for p in self.loading for m in self.source.path_modules[p]}
        resident = sum(self.source.nbytes[m] for m in self.modules)
        evictable = [m for m in self.modules if m not in protected]
        if resident + nbytes - sum(self.source.nbytes[m] for m in evictable) > self.budget:
            return False
        for m in evictable:
            if resident + nbytes <= self.budget:
                break
            del self.modules[m]
            resident -= self.source.nbytes[m]
            for p in [p for p in self.models if m in self.source.path_modules[p]]:
                del self.models[p]
            if self.metrics is not None:
                self.metrics.module_evicted()
        return True
