"""What eval reads from a run and its shards: the documents to score (held-out, validation, router documents) as
token lists, the check that a run belongs to the shards, and the shard router that answers for the run."""

from __future__ import annotations

import numpy as np

from dipaco.errors import DipacoError
from dipaco.routing import Router
from dipaco.routing.router import BaseRouter
from dipaco.sharding.tokenizer import encode
from dipaco.storage.run import Run
from dipaco.storage.shards import ShardSet, read_docs


def heldout_tokens(shards: ShardSet, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    docs = shards.heldout()
    if not docs:
        raise DipacoError(f"{shards.root} has no held-out documents; re-shard with data.heldout_fraction > 0")
    ids = [t[:max_tokens] for t in encode(shards.tokenizer(), [d["text"] for d in docs])]
    return docs, ids


def validation_tokens(shards: ShardSet, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    """The validation documents of every path (whole documents, never trained on), from their tokens: the
    data to choose settings on, so that the held-out documents stay a test set."""
    docs, ids = [], []
    for p in shards.paths:
        tokens, offsets = shards.tokens(p, "val"), shards.doc_offsets(p, "val")
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            doc = np.asarray(tokens[a:b], dtype=np.int64)
            if len(doc) and doc[-1] == shards.eos_token_id:
                doc = doc[:-1]  # the writer's document separator
            docs.append({"label": None, "path": p})
            ids.append(doc[:max_tokens].tolist())
    if not docs:
        raise DipacoError(f"{shards.root} has no validation documents; re-shard with data.val_fraction > 0")
    return docs, ids


SPLITS = {"heldout": heldout_tokens, "val": validation_tokens}  # --split: the test set, the documents to tune on


def router_tokens(shards: ShardSet, max_tokens: int) -> list[list[int]]:
    """The router documents' tokens (kept out of training and of the router's fit); none when the shards keep none."""
    docs = read_docs(shards.root, "router_docs")
    return [t[:max_tokens] for t in encode(shards.tokenizer(), [d["text"] for d in docs])] if docs else []


def check_compatible(run: Run, shards: ShardSet) -> None:
    if run.info.get("tokenizer_sha256") != shards.manifest["tokenizer"]["sha256"]:
        raise DipacoError(f"run {run.root} was trained with another tokenizer than {shards.root}; evaluate it with its own "
                          f"--shards {run.info.get('shards_dir')}")
    if not run.is_dense and run.info.get("shards_fingerprint") != shards.fingerprint:
        raise DipacoError(f"run {run.root} was trained on other shards (another router) than {shards.root}; "
                          f"evaluate it with --shards {run.info.get('shards_dir')}")


def shard_router(shards: ShardSet, context: int) -> BaseRouter:
    """The router that built the shards; it must read only unscored tokens."""
    router = Router.load(shards.root / "router")
    if router.input.tokens > context:
        raise DipacoError(f"the router of {shards.root} reads the first {router.input.tokens} tokens but eval.context_tokens "
                          f"is {context}, so routing would see scored tokens; set eval.context_tokens >= {router.input.tokens}")
    return router


def route_documents(run: Run, router: BaseRouter | None, ids: list[list[int]]) -> list[str]:
    """The path of every document: the shard router on its first tokens (a dense run: its single path)."""
    if run.is_dense:
        return [run.grid.paths[0]] * len(ids)
    return router.route_ids(ids)
