"""Local lm-evaluation-harness tasks built from a shard directory's held-out documents, written as a JSON lines file
and a task YAML into a folder for the harness's ``include_path`` (``dataset_path: json``: no hub, works offline).

- ``heldout_ppl``: every held-out document as a ``loglikelihood_rolling`` request (the documents ``dipaco eval``
  scores; with the dipaco model's default ``rolling=dipaco`` the summed log-likelihood is dipaco eval's).
- ``heldout_choice``: multiple choice. A passage is a document's first ``passage`` tokens; the right answer is its next
  ``answer`` tokens; the wrong ones are the tokens at the same place of other held-out documents of the same domain
  (the shard's label), so a model has to continue this passage, not merely this kind of text. A document takes part
  when its domain has at least ``choices`` long enough documents.
- ``heldout_gen``: generation: the passage, greedily continued for ``answer`` tokens up to a newline; exact match
  against the true continuation's first line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from dipaco.errors import DipacoError
from dipaco.storage.shards import ShardSet


def _write(folder: Path, name: str, rows: list[dict], yaml: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    head = (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
            f"test_split: test\n")
    (folder / f"{name}.yaml").write_text(head + yaml + "metadata:\n  version: 1.0\n", encoding="utf-8")
    return name


def _metrics(higher: bool = True, **aggregations: str) -> str:
    """A task YAML's metric_list entries (with their aggregation, so the harness has nothing to warn about)."""
    return "".join(f"  - metric: {m}\n    aggregation: {a}\n    higher_is_better: {str(higher).lower()}\n"
                   for m, a in aggregations.items())


def rolling_task(folder: str | Path, docs: list[dict], name: str = "heldout_ppl") -> str:
    """A ``loglikelihood_rolling`` task over ``docs`` ({"text", "label"}); returns its name."""
    rows = [{"text": d["text"], "domain": d.get("label")} for d in docs]
    return _write(Path(folder), name, rows, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                  'doc_to_target: "{{text}}"\nmetric_list:\n' + _metrics(word_perplexity="weighted_perplexity",
                  byte_perplexity="weighted_perplexity", bits_per_byte="bits_per_byte", higher=False))


def passages(tokenizer, docs: list[dict], passage: int, answer: int) -> list[dict]:
    """{"passage", "answer", "domain"} of every document with at least ``passage + answer`` tokens, as decoded text."""
    out = []
    for d in docs:
        ids = tokenizer(d["text"], add_special_tokens=False)["input_ids"]
        if len(ids) >= passage + answer:
            out.append({"passage": tokenizer.decode(ids[:passage]), "domain": d.get("label"),
                        "answer": tokenizer.decode(ids[passage:passage + answer])})
    return out


def choice_rows(items: list[dict], choices: int = 4, seed: int = 0) -> list[dict]:
    """One question per item whose domain has ``choices - 1`` other items: its answer among theirs, shuffled."""
    rng = random.Random(seed)
    by_domain: dict = {}
    for i, item in enumerate(items):
        by_domain.setdefault(item["domain"], []).append(i)
    rows = []
    for i, item in enumerate(items):
        others = [j for j in by_domain[item["domain"]] if j != i and items[j]["answer"] != item["answer"]]
        if len(others) < choices - 1:
            continue
        options = [item["answer"]] + [items[j]["answer"] for j in rng.sample(others, choices - 1)]
        order = list(range(choices))
        rng.shuffle(order)
        rows.append({"passage": item["passage"], "choices": [options[k] for k in order], "label": order.index(0),
                     "domain": item["domain"]})
    return rows


def choice_task(folder: str | Path, tokenizer, docs: list[dict], passage: int = 48, answer: int = 16, choices: int = 4,
                seed: int = 0, name: str = "heldout_choice") -> str:
    rows = choice_rows(passages(tokenizer, docs, passage, answer), choices, seed)
    if not rows:
        raise DipacoError(f"no held-out domain has {choices} documents of {passage + answer} tokens or more; "
                          f"give fewer choices or shorter passages")
    # the answer follows the passage directly: the split is at a token boundary, not at a space
    return _write(Path(folder), name, rows, 'output_type: multiple_choice\ndoc_to_text: "{{passage}}"\n'
                  'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\ntarget_delimiter: ""\nmetric_list:\n'
                  + _metrics(acc="mean", acc_norm="mean"))


def generation_task(folder: str | Path, tokenizer, docs: list[dict], passage: int = 48, answer: int = 16,
                    name: str = "heldout_gen", until: tuple[str, ...] = ("\n",)) -> str:
    """Greedy continuations of ``answer`` tokens at most, cut at the first of ``until``."""
    rows = [{"passage": p["passage"], "answer": p["answer"].split("\n")[0], "domain": p["domain"]}
            for p in passages(tokenizer, docs, passage, answer)]
    return _write(Path(folder), name, rows, 'output_type: generate_until\ndoc_to_text: "{{passage}}"\n'
                  'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\ngeneration_kwargs:\n'
                  f'  until: {json.dumps(list(until))}\n  max_gen_toks: {answer}\n  do_sample: false\n'
                  'metric_list:\n' + _metrics(exact_match="mean"))


def heldout_tasks(shards_dir: str | Path, folder: str | Path, passage: int = 48, answer: int = 16, choices: int = 4,
                  seed: int = 0) -> list[str]:
    """The three tasks over the held-out documents of ``shards_dir``, written into ``folder``: their names."""
    shards = ShardSet(shards_dir)
    docs, tok = shards.heldout(), shards.tokenizer()
    return [rolling_task(folder, docs), choice_task(folder, tok, docs, passage, answer, choices, seed),
            generation_task(folder, tok, docs, passage, answer)]
