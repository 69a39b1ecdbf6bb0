"""Routed generation: route the prompt, load only the chosen path, generate with transformers.

``--mixture k`` mixes the next-token distributions of the k nearest paths with c-BTM weights
softmax(-d^2 / T) of the router distances; it runs its own decoding loop (one KV cache per path).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from dipaco.command_config import GenerateConfig as G  # the defaults, declared once
from dipaco.command_config import check_max_new_tokens
from dipaco.errors import DipacoError
from dipaco.eval.once_policy import OnceRule, decide_once, once_rule_of, router_log_prior
from dipaco.eval.perplexity import check_mixture, mixture_weights
from dipaco.eval.window_policy import Rule, decide, rule_of

if TYPE_CHECKING:  # only for annotations: RoutedRun.generate calls generate()
    from dipaco.eval.api import RoutedRun


@dataclass
class Generation:
    prompt: str
    text: str                      # the generated continuation (prompt not included)
    paths: list[tuple[str, float]]  # (path, weight): one path with weight 1 unless mixing
    bytes_loaded: int              # module bytes read for this generation
    bytes_total: int               # all module bytes of the checkpoint round
    new_tokens: int = 0
    segments: list[tuple[str, int]] | None = None  # re-routing every W tokens: (path, new tokens) in order
    router: str = "shard router on the prompt's first tokens"
    prompt_cut: int = 0            # tokens dropped from the start of a prompt longer than the model's window
    prompt_tokens: int = 0         # prompt tokens the model read
    max_seq_len: int = 0


def _prompt_ids(rr: RoutedRun, prompt: str, max_new_tokens: int) -> tuple[torch.Tensor, int]:
    """The prompt's token ids the model reads, and how many were cut from its start.

    The model was trained on ``max_seq_len`` tokens: a longer prompt keeps its last tokens (room for
    ``max_new_tokens`` more, but at least half the window). Routing still reads the prompt's first tokens,
    like a document's."""
    ids = rr.encode(prompt)
    if not ids:
        raise DipacoError("the prompt is empty (zero tokens); give some text to continue, e.g. dipaco generate --run RUN \"def main\"")
    limit, cut = rr.run.config.model.max_seq_len, 0
    if len(ids) > limit:
        cut = len(ids) - max(limit - max_new_tokens, limit // 2)
        ids = ids[cut:]
    return torch.tensor([ids], dtype=torch.long), cut


@torch.inference_mode()
def generate(rr: RoutedRun, prompt: str, max_new_tokens: int = G.max_new_tokens, temperature: float = G.temperature,
             top_p: float = G.top_p, seed: int = G.seed, round: int | None = None, mixture: int = 0,
             mixture_temperature: float = G.mixture_temperature,
             path: str | None = None, route_every: int | None = None) -> Generation:
    """Greedy when ``temperature`` is 0, else sampling with ``temperature`` and ``top_p`` (seeded).

    The prompt is routed like a document, by the run's once rule (``route_prompt``: the rule eval follows, chosen and
    saved first when the run has none). ``route_every`` W > 0 re-routes after every W new tokens with the run's every-W
    rule (the best rule that runs one path, chosen on the router documents by ``dipaco fit-window-router``; without
    one, the prompt's path throughout); None does so when the run has exactly one fitted W, 0 never."""
    check_max_new_tokens(max_new_tokens)
    if temperature < 0 or not 0 < top_p <= 1:
        raise DipacoError(f"sampling options temperature={temperature}, top_p={top_p} are not valid; "
                          f"use temperature >= 0 (0 = greedy) and 0 < top_p <= 1")
    check_mixture(mixture, rr.run)
    ids, cut = _prompt_ids(rr, prompt, max_new_tokens)
    cut_info = dict(prompt_cut=cut, prompt_tokens=ids.shape[1], max_seq_len=rr.run.config.model.max_seq_len)
    if mixture > 1 and not rr.run.is_dense and path is None:
        g = _generate_mixture(rr, prompt, ids, max_new_tokens, temperature, top_p, seed, round, mixture,
                              mixture_temperature)
        return replace(g, **cut_info)
    chosen, how, scored = (path, "the given path", []) if path is not None else route_prompt(rr, prompt, round)
    if route_every is None:
        sizes = rr.window_sizes()
        route_every = sizes[0] if len(sizes) == 1 else 0
    if route_every < 0:
        raise DipacoError(f"--route-every {route_every} is not valid; use W > 0 tokens, or 0 to keep one path")
    if path is not None or rr.run.is_dense:
        route_every = 0
    torch.manual_seed(seed)
    # top_k=0: only temperature and top_p shape the distribution (transformers defaults top_k to 50)
    options = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else dict(do_sample=False)
    eos = rr.run.info["eos_token_id"]
    window = rr.window_router(route_every) if route_every else None
    rule, why = every_w_rule(rr, route_every)
    models, segments, context, first = {}, [], ids, chosen
    while len(new := context[0, ids.shape[1]:].tolist()) < max_new_tokens and (not new or new[-1] != eos):
        if segments:  # what came before the next segment chooses its path
            chosen = next_path(rr, rule, window, context[0].tolist(), first, chosen, [n for _, n in segments],
                               loaded_scorer(rr, round, models))
        if chosen not in models:
            models[chosen] = rr.path_model(chosen, round).model
        n = min(route_every or max_new_tokens, max_new_tokens - len(new))
        out = models[chosen].generate(context, attention_mask=torch.ones_like(context), max_new_tokens=n,
                                      pad_token_id=eos, eos_token_id=eos, **options)
        segments.append((chosen, out.shape[1] - context.shape[1]))
        context = out
    # a prefix-loss or lagged-loss rule reads (and scores with) every path
    loaded, total = rr.bytes_of(list(dict.fromkeys(scored + list(models))), round)
    used = list(dict.fromkeys(p for p, _ in segments))
    if route_every:
        how += f", then every {route_every} tokens {rule.name}: {rule.describe(route_every)} ({why})"
    weights = [(p, sum(n for q, n in segments if q == p) / max(1, len(new))) for p in used]
    return Generation(prompt, rr.decode(new), weights, loaded, total, len(new), segments, how, **cut_info)


def route_prompt(rr: RoutedRun, prompt: str, round: int | None = None, score=None) -> tuple[str, str, list[str]]:
    """The prompt's path under the run's once rule (``route_ids`` on its tokens)."""
    return route_ids(rr, rr.encode(prompt), round, score)


def route_ids(rr: RoutedRun, ids: list[int], round: int | None = None, score=None,
              rule: OnceRule | None = None) -> tuple[str, str, list[str]]:
    """The path of a text given as token ids under the run's once rule (``RoutedRun.find_once_policy``:
    RUN/routing/once.json, the rule eval routes by; ``rule`` overrides it), how it was chosen, and the paths read to
    choose it. A prefix-loss rule scores the first ``eval.context_tokens`` tokens with every path, as eval scores a
    document's routing context; ``score`` (``loaded_scorer`` by default) runs those forward passes."""
    if rr.run.is_dense:
        return rr.paths[0], "shard router on the prompt's first tokens", []
    shard_path = rr.router.route_ids([ids])[0]
    policy = rr.find_once_policy() if rule is None else {"reason": "chosen for this server"}
    rule = once_rule_of(policy["chosen"]) if rule is None else rule
    context = rr.run.config.eval.context_tokens
    tokens = list(ids[:context])
    if rule.kind == "shard-router" or len(tokens) < 2:
        origin = "chosen on the router documents" if "chosen" in policy else policy["reason"]
        why = f"{rule.name}, {origin}" if rule.kind == "shard-router" else f"{rule.name} needs 2 prompt tokens"
        return shard_path, f"shard router on the prompt's first tokens ({why})", []
    paths = rr.run.grid.paths
    score = score or loaded_scorer(rr, round)
    nll = [float(x.sum(dtype=np.float64)) for x in score([(p, tokens) for p in paths])]
    prior = router_log_prior(rr.router, rr.router.distances_of_ids([tokens]))
    chosen = decide_once(rule, paths, [shard_path], np.array([nll]), prior)[0]
    return chosen, f"once, {rule.name}: {rule.describe(context)} ({policy['reason']})", paths


def loaded_scorer(rr: RoutedRun, round: int | None = None, models: dict | None = None):
    """``score([(path, ids), ...])`` -> every target's NLL (len(ids) - 1 values) under each path, loading a path's model
    when first needed (into ``models``, kept there), one sequence at a time."""
    models = {} if models is None else models

    @torch.no_grad()
    def score(requests):
        out = []
        for p, ids in requests:
            if p not in models:
                models[p] = rr.path_model(p, round).model
            x = torch.as_tensor([list(ids)], dtype=torch.long)
            logits = models[p](input_ids=x, use_cache=False).logits[0, :-1].float()
            out.append(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none").numpy())
        return out

    return score


def every_w_rule(rr: RoutedRun, w: int) -> tuple[Rule, str]:
    """The every-W rule: the best rule that runs one path, chosen on the router documents for this run
    (``policy.json``). Without one, or with one chosen against another once rule, "stay": the prompt's path
    throughout, never worse than routing once."""
    from dipaco.eval.window_policy import read_window_policy, stale_window_policy, window_policy_file

    policy = read_window_policy(rr.run, rr.shards, w) if w else None
    if policy is None:
        return Rule("stay"), f"no every-{w} rule chosen for this run; choose one with dipaco fit-window-router"
    f = window_policy_file(rr.run, w)
    stale = stale_window_policy(policy, rr.find_once_policy()["name"])
    if stale is not None:
        return Rule("stay"), f"{f} {stale}: the prompt keeps its path"
    one = policy.get("one_path") or policy
    return rule_of(one["chosen"]), f"chosen on the router documents: {one['reason']}"


def next_path(rr: RoutedRun, rule: Rule, window, tokens: list[int], first: str, current: str, spans: list[int],
              score) -> str:
    """The path of the next segment of a text re-routed every W tokens: ``tokens`` is all of it so far, ``spans`` the
    new tokens of each earlier segment; ``score`` as ``loaded_scorer`` (a lagged-loss rule scores every path)."""
    paths = rr.run.grid.paths
    if rule.kind == "stay":
        return first
    if rule.kind == "shard-router":
        return rr.router.route_ids([tokens[-rule.lookback:]])[0]
    if rule.kind == "window-router":
        ids = [tokens[-window.input.tokens:]]
        return decide(rule, [[(0, 1), (len(ids[0]), len(ids[0]) + 1)]], [first], ids, paths, window_router=window)[0][1]
    # lagged-loss: every path scores the previous chunk(s) of the text (with their context), the rule picks
    keep = spans if rule.lookback == 0 else spans[-rule.lookback:]
    start = len(tokens) - sum(keep)
    window_ids = tokens[-rr.run.config.model.max_seq_len:]
    offset = len(tokens) - len(window_ids)
    nll = [float(x[max(0, start - offset - 1):].sum()) for x in score([(p, window_ids) for p in paths])]
    cut = [(0, sum(keep)), (sum(keep), sum(keep) + 1)]
    chunk_nll = [np.array([nll, [0.0] * len(paths)])]
    lagged = Rule("lagged-loss", rule.margin, 1)
    return decide(lagged, [cut], [current], [tokens], paths, chunk_nll=chunk_nll)[0][1]


def _generate_mixture(rr: RoutedRun, prompt, ids, max_new_tokens, temperature, top_p, seed, round, k, mix_t) -> Generation:
    mix = mixture_weights(rr.route_topk([prompt], k)[0], mix_t)
    models = [rr.path_model(p, round).model for p, _ in mix]
    weights = torch.tensor([w for _, w in mix], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    eos = rr.run.info["eos_token_id"]
    # transformers renamed past_key_values to cache (5.x); use whichever this version's forward takes
    kw = "cache" if "cache" in inspect.signature(models[0].forward).parameters else "past_key_values"
    caches, step_ids, new = [None] * len(models), ids, []
    for _ in range(max_new_tokens):
        probs = torch.zeros(rr.run.info["vocab_size"], dtype=torch.float64)
        for i, m in enumerate(models):
            out = m(input_ids=step_ids, use_cache=True, **{kw: caches[i]})
            caches[i] = out[kw]
            probs += weights[i] * torch.softmax(out.logits[0, -1].double(), dim=-1)
        if temperature > 0:
            probs = _top_p(torch.softmax(probs.log() / temperature, dim=-1), top_p)
            token = int(torch.multinomial(probs, 1, generator=gen))
        else:
            token = int(probs.argmax())
        new.append(token)
        if token == eos:
            break
        step_ids = torch.tensor([[token]], dtype=torch.long)
    loaded, total = rr.bytes_of([p for p, _ in mix], round)
    return Generation(prompt, rr.decode(new), mix, loaded, total, len(new))


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (nucleus sampling)."""
    if top_p >= 1:
        return probs
    sorted_p, order = probs.sort(descending=True)
    keep = sorted_p.cumsum(0) - sorted_p < top_p  # the top token is always kept
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()
