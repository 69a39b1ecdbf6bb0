"""The run's saved routing rules (RUN/routing/once.json, RUN/window_routers/w<W>/policy.json): decided once and found by
every command, a damaged file is one line naming the command that rewrites it, and that command may replace it."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dipaco.errors import DipacoError
from dipaco.eval import once_policy
from dipaco.eval.once_policy import read_once_policy
from dipaco.eval.window_policy import read_window_policy
from dipaco.storage.outputs import atomic_dir, check_replaceable

ONCE = {"chosen": {"kind": "prefix-loss", "prior": False}, "name": "prefix-loss", "reason": "a test", "round": 2}


def _run(tmp_path: Path):
    """A directory dipaco counts as a run (its run.json), and stand-ins with the attributes the readers use."""
    root = tmp_path / "run"
    root.mkdir()
    (root / "run.json").write_text(json.dumps({"shards_fingerprint": "f"}))
    return SimpleNamespace(root=root, latest=lambda: 2), SimpleNamespace(root=tmp_path / "shards")


@pytest.mark.parametrize("content,why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    (json.dumps(ONCE | {"chosen": {"kind": "nearest"}}), "unknown rule 'nearest'; known: shard-router, prefix-loss"),
    (json.dumps({"chosen": {"kind": "shard-router"}}), "no 'name' and 'reason'"),
    (json.dumps(ONCE | {"chosen": {"kind": "prefix-loss", "prior": "yes"}}), "prior 'yes' is not true or false"),
])
def test_a_damaged_once_rule_names_the_command_that_rewrites_it(tmp_path, content, why):
    run, shards = _run(tmp_path)
    (run.root / "routing").mkdir()
    (run.root / "routing" / "once.json").write_text(content)
    with pytest.raises(DipacoError) as exc:
        read_once_policy(run, shards)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{run.root / 'routing' / 'once.json'} is damaged (") and why in msg
    assert msg.endswith(f"write it again with: dipaco choose-routing --run {run.root} --shards {shards.root} --overwrite")


@pytest.mark.parametrize("policy,why", [
    ({"chosen": {"kind": "sometimes"}, "reason": "r"}, "unknown rule 'sometimes'"),
    ({"chosen": {"kind": "lagged-loss", "margin": "big"}, "reason": "r"}, "margin 'big' is not a number"),
    ({"chosen": {"kind": "shard-router", "lookback": -1}, "reason": "r"}, "lookback -1 is not a whole number"),
    ({"chosen": {"kind": "stay"}, "reason": "r", "one_path": {"chosen": None}}, "no rule under 'chosen'"),
    ({"chosen": {"kind": "stay"}}, "no 'reason'"),
    ({"chosen": {"kind": "window-router"}, "reason": "r"}, "needs the window router, and router.json is missing"),
])
def test_a_damaged_every_w_rule_names_the_command_that_rewrites_it(tmp_path, policy, why):
    run, shards = _run(tmp_path)
    folder = run.root / "window_routers" / "w64"
    folder.mkdir(parents=True)
    (folder / "policy.json").write_text(json.dumps(policy))
    with pytest.raises(DipacoError, match="is damaged") as exc:
        read_window_policy(run, shards, 64)
    assert why in str(exc.value) and str(exc.value).endswith(
        f"dipaco fit-window-router --run {run.root} --shards {shards.root} --window 64 --overwrite")
    (folder / "policy.json").write_text(json.dumps({"chosen": {"kind": "stay"}, "reason": "r", "split": "router_docs"}))
    assert read_window_policy(run, shards, 64)["chosen"] == {"kind": "stay"}
    assert read_window_policy(run, shards, 32) is None and read_once_policy(run, shards) is None


def test_overwrite_replaces_a_damaged_policy_but_never_a_users_files(tmp_path):
    run, _ = _run(tmp_path)
    routing, window = run.root / "routing", run.root / "window_routers" / "w64"
    for folder, name in ((routing, "once.json"), (window, "policy.json")):
        folder.mkdir(parents=True)
        (folder / name).write_text("{damaged")
        check_replaceable(folder)  # dipaco's name in dipaco's folder of a dipaco run
        with atomic_dir(folder, overwrite=True) as tmp:
            (tmp / name).write_text(json.dumps(ONCE))
        assert json.loads((folder / name).read_text()) == ONCE
        (folder / name).write_text("{damaged")
        (folder / "notes.txt").write_text("mine")  # a user's file beside it: the folder is theirs
        with pytest.raises(DipacoError, match="holds files dipaco did not write"):
            check_replaceable(folder)
        (folder / "notes.txt").unlink()
    (routing / "once.json").write_text("x" * ((1 << 20) + 1))  # far too big to be a policy
    with pytest.raises(DipacoError, match="holds files dipaco did not write"):
        check_replaceable(routing)
    other = tmp_path / "not-a-run" / "routing"  # the same names outside a dipaco run stay the user's
    other.mkdir(parents=True)
    (other / "once.json").write_text("{damaged")
    with pytest.raises(DipacoError, match="holds files dipaco did not write"):
        check_replaceable(other)


def test_the_first_command_chooses_and_saves_and_later_ones_read(tmp_path, monkeypatch):
    run, shards = _run(tmp_path)
    chosen = []
    monkeypatch.setattr(once_policy, "choose_once_policy",
                        lambda run_, shards_, r, progress: chosen.append(r) or dict(ONCE, round=r))
    first = once_policy.find_once_policy(run, shards, progress=False)
    f = run.root / "routing" / "once.json"
    assert chosen == [2] and first["chosen_now"] and first["saved_to"] == str(f) and json.loads(f.read_text()) == ONCE
    assert "saved to" in once_policy.once_notice(run.root, first)
    second = once_policy.find_once_policy(run, shards, progress=False)
    assert chosen == [2] and second["source"] == str(f) and "chosen_now" not in second
    assert once_policy.once_notice(run.root, second) is None
    assert not [p for p in run.root.rglob(".*")]  # no temporary folder left behind


def test_an_empty_routing_folder_takes_the_choice(tmp_path, monkeypatch):
    run, shards = _run(tmp_path)
    (run.root / "routing").mkdir()
    monkeypatch.setattr(once_policy, "choose_once_policy", lambda *a: dict(ONCE))
    assert once_policy.find_once_policy(run, shards, progress=False)["saved_to"]
    assert read_once_policy(run, shards)["name"] == "prefix-loss"


def test_a_run_that_cannot_keep_the_rule_uses_it_unsaved_and_says_so(tmp_path, monkeypatch):
    run, shards = _run(tmp_path)
    monkeypatch.setattr(once_policy, "choose_once_policy", lambda *a: dict(ONCE))

    def read_only(*_a, **_k):
        raise PermissionError(13, "Permission denied", str(run.root / "routing"))

    monkeypatch.setattr(once_policy, "write_once_policy", read_only)
    policy = once_policy.find_once_policy(run, shards, progress=False)
    assert policy["name"] == "prefix-loss" and policy["chosen_now"] and policy["saved_to"] is None
    notice = once_policy.once_notice(run.root, policy)
    assert "for this command only" in notice and "Permission denied" in notice and "\n" not in notice
    assert not (run.root / "routing").exists()
    # a user's file in RUN/routing: the same (never replaced)
    monkeypatch.undo()
    monkeypatch.setattr(once_policy, "choose_once_policy", lambda *a: dict(ONCE))
    (run.root / "routing").mkdir()
    (run.root / "routing" / "notes.txt").write_text("mine")
    policy = once_policy.find_once_policy(run, shards, progress=False)
    assert policy["saved_to"] is None and "did not write" in policy["source"]
    assert [p.name for p in (run.root / "routing").iterdir()] == ["notes.txt"]


def test_a_rule_saved_meanwhile_by_another_command_wins(tmp_path, monkeypatch):
    """Two commands choosing at once: the one that saves second finds the saved rule and follows it."""
    run, shards = _run(tmp_path)
    monkeypatch.setattr(once_policy, "choose_once_policy", lambda *a: dict(ONCE, reason="mine"))

    def saved_by_another(run_, policy, overwrite=False):
        (run.root / "routing").mkdir()
        (run.root / "routing" / "once.json").write_text(json.dumps(ONCE | {"reason": "theirs"}))
        raise DipacoError(f"{run.root / 'routing'} already exists")

    monkeypatch.setattr(once_policy, "write_once_policy", saved_by_another)
    assert once_policy.find_once_policy(run, shards, progress=False)["reason"] == "theirs"
