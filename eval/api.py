"""The Python API for a trained run: route texts, get one path's model, generate, export.

    from dipaco.eval.api import load

    rr = load("runs/dipaco")                      # router and tokenizer from the run's shard dir
    rr.route(["def main():", "To be, or not to be"])   # -> ['0-1', '1-0'] (the shard router)
    rr.path_for("def main():")                    # the path the run's once rule answers with, as eval and generate
    model = rr.model_for("def main():")           # a transformers LlamaForCausalLM of that path
    rr.generate("def main():", max_new_tokens=20).text
    rr.export("0-1", "exported/")                 # plain Hugging Face directory
"""

from __future__ import annotations

from pathlib import Path

from dipaco.errors import DipacoError
from dipaco.model.path_model import PathModel
from dipaco.routing import Router
from dipaco.storage import checkpoint
from dipaco.storage.run import Run
from dipaco.storage.shards import ShardSet


class RoutedRun:
    """A run plus the router and tokenizer of the shards it was trained on."""

    def __init__(self, run: str | Path | Run, shards: str | Path | None = None, progress: bool = True):
        self.run = run if isinstance(run, Run) else Run(run)
        self.progress = progress  # bars while the once rule is chosen (a run without RUN/routing/once.json)
        shards = shards if shards is not None else self.run.info.get("shards_dir")
        if shards is None:
            raise DipacoError(f"{self.run.root / 'run.json'} records no shards_dir; pass --shards SHARDS")
        self.shards = ShardSet(shards)
        if self.run.info.get("tokenizer_sha256") != self.shards.manifest["tokenizer"]["sha256"]:
            raise DipacoError(f"run {self.run.root} was trained with another tokenizer than {self.shards.root}; "
                              f"pass the run's own --shards ({self.run.info.get('shards_dir')})")
        if not self.run.is_dense and self.run.info.get("shards_fingerprint") != self.shards.fingerprint:
            raise DipacoError(f"run {self.run.root} was trained on other shards (another router) than {self.shards.root}; "
                              f"pass --shards {self.run.info.get('shards_dir')}")
        self.tokenizer = self.shards.tokenizer()
        self._router: Router | None = None
        self._unsaved_once: dict | None = None
        self.once_chosen_now: dict | None = None  # the once rule, when this object chose it (for a command to say so)

    @property
    def paths(self) -> list[str]:
        return self.run.grid.paths

    @property
    def router(self) -> Router:
        if self._router is None:
            self._router = Router.load(self.shards.root / "router")
        return self._router

    # -------------------------------------------------------------- routing
    def route(self, texts: list[str]) -> list[str]:
        """The shard router's path id per text (a dense run always answers its single path). ``path_for``, ``generate``
        and eval follow the run's once rule instead (``find_once_policy``), which may score the text's first tokens with
        every path."""
        if isinstance(texts, str):
            raise DipacoError("route takes a list of texts, not a single string; wrap it: route([text])")
        return [self.paths[0]] * len(texts) if self.run.is_dense else self.router.route(texts)

    def find_once_policy(self) -> dict:
        """The run's once rule, the one every command routes by: RUN/routing/once.json, or, for a run without it,
        chosen now on the router documents and saved there (``dipaco.eval.once_policy.find_once_policy``)."""
        from dipaco.eval.once_policy import find_once_policy

        if self._unsaved_once is not None:  # chosen once already, and the run directory could not keep it
            return self._unsaved_once
        policy = find_once_policy(self.run, self.shards, self.progress)
        if policy.get("chosen_now"):
            self.once_chosen_now = policy
            if policy.get("saved_to") is None:
                self._unsaved_once = policy
        return policy

    def path_for(self, text: str, round: int | None = None) -> str:
        """The path the run's once rule gives ``text`` (what eval and generate answer it with)."""
        from dipaco.eval.generate import route_prompt

        return route_prompt(self, text, round)[0]

    def window_router(self, w: int):
        """The run's router for every-``w`` routing (``dipaco fit-window-router``), or None."""
        from dipaco.eval.window_router import load_window_router

        return None if self.run.is_dense else load_window_router(self.run, self.shards, w)

    def window_sizes(self) -> list[int]:
        """The W of every window router saved with the run."""
        folder = self.run.root / "window_routers"
        return sorted(int(d.name[1:]) for d in folder.glob("w*") if d.name[1:].isdigit()) if folder.is_dir() else []

    def route_topk(self, texts: list[str], k: int) -> list[list[tuple[str, float]]]:
        """The k nearest paths of each text with their squared router distances, nearest first."""
        if self.run.is_dense:
            return [[(self.paths[0], 0.0)] for _ in texts]
        return self.router.route_topk(texts, k)

    # --------------------------------------------------------------- models
    def check_path(self, path: str) -> str:
        if path not in self.paths:
            raise DipacoError(f"path {path!r} is not in run {self.run.root} (grid {self.run.info['grid']}); "
                              f"choose one of {', '.join(self.paths)}")
        return path

    def path_model(self, path: str, round: int | None = None) -> PathModel:
        """Only this path's modules are read from the checkpoint."""
        return self.run.path_model(self.check_path(path), round)

    def model_for(self, text: str, round: int | None = None):
        """The transformers model of the path the run's once rule picks for ``text`` (``path_for``)."""
        return self.path_model(self.path_for(text, round), round).model

    def bytes_of(self, paths: list[str], round: int | None = None) -> tuple[int, int]:
        """(bytes of the modules these paths need, bytes of all modules) in the round's checkpoint."""
        r = self.run.latest() if round is None else round
        folder = checkpoint.round_dir(self.run.root, r) / "modules"
        needed = {m for p in paths for m in self.run.grid.path_modules(p)}
        total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        return sum((folder / f"{m}.safetensors").stat().st_size for m in needed), total

    # ----------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt: str, **options):
        from dipaco.eval.generate import generate

        return generate(self, prompt, **options)

    def export(self, path: str, out: str | Path, round: int | None = None, overwrite: bool = False) -> Path:
        from dipaco.eval.export import export_path

        return export_path(self, path, out, round, overwrite)


def load(run: str | Path, shards: str | Path | None = None, progress: bool = True) -> RoutedRun:
    """Open a trained run for routing, scoring and generation (``progress``: bars for long work)."""
    return RoutedRun(run, shards, progress)
