"""Routed generation, the Python API and the generate CLI."""

import pytest

from dipaco.cli.commands import main
from dipaco.errors import DipacoError
from dipaco.eval.api import load
from dipaco.eval.generate import generate

from eval_helpers import private_run

pytestmark = pytest.mark.slow  # a trained run (real shards)

PROMPT = "def main():\n    return"


@pytest.fixture(scope="module")
def rr(tmp_path_factory, shards_2x2):
    return load(private_run(tmp_path_factory, shards_2x2))


def test_greedy_is_deterministic_and_loads_one_path(rr):
    a = generate(rr, PROMPT, max_new_tokens=12)
    b = rr.generate(PROMPT, max_new_tokens=12)
    assert a.text == b.text and a.new_tokens == 12
    assert a.paths == [(rr.route([PROMPT])[0], 1.0)]
    assert 0 < a.bytes_loaded < a.bytes_total  # only the chosen path's modules are read
    s1 = generate(rr, PROMPT, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=3)
    s2 = generate(rr, PROMPT, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=3)
    assert s1.text == s2.text


def test_mixture_with_one_dominant_path_equals_routed(rr):
    routed = generate(rr, PROMPT, max_new_tokens=10)
    # a tiny temperature puts all weight on the nearest path: the mixture loop must reproduce generate()
    mixed = generate(rr, PROMPT, max_new_tokens=10, mixture=2, mixture_temperature=1e-9)
    assert mixed.paths[0][0] == routed.paths[0][0] and mixed.paths[0][1] == pytest.approx(1.0)
    assert mixed.text == routed.text
    soft = generate(rr, PROMPT, max_new_tokens=5, mixture=2, mixture_temperature=10.0)
    assert len(soft.paths) == 2 and soft.bytes_loaded > routed.bytes_loaded


def test_api_routes_and_gives_path_models(rr):
    paths = rr.route(["int main(void) {", "Permission is hereby granted, free of charge"])
    assert all(p in rr.paths for p in paths)
    assert rr.model_for("int main(void) {").config.num_hidden_layers == 4
    top = rr.route_topk(["int main(void) {"], 2)[0]
    assert top[0][0] == rr.route(["int main(void) {"])[0] and top[0][1] <= top[1][1]


def test_bad_inputs(rr, tmp_path, capsys):
    with pytest.raises(DipacoError, match="empty"):
        generate(rr, "", max_new_tokens=4)
    with pytest.raises(DipacoError, match="not in run"):
        rr.path_model("7-7")
    with pytest.raises(DipacoError):
        generate(rr, PROMPT, top_p=0.0)
    for n in (0, -1):  # one rule, one message, from the API and the command line alike
        with pytest.raises(DipacoError, match=rf"'max_new_tokens' \(--max-new-tokens\) is {n}: ask for at least 1 new token"):
            generate(rr, PROMPT, max_new_tokens=n)
    assert main(["generate", "--run", str(rr.run.root), "--quiet", ""]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["generate", "--run", str(rr.run.root), "--path", "9", "--quiet", "x"]) == 2


def test_generate_cli_prompts_file(rr, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nint main\n")
    assert main(["generate", "--run", str(rr.run.root), "--prompts-file", str(prompts), "--max-new-tokens", "4",
                 "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def f(x):") and "int main" in out.out
    assert out.err.count("# path ") == 2 and "% of the model" in out.err
    # --prompt TEXT (not an abbreviation of --prompts-file), beside a positional prompt and the file: every one, in order
    assert main(["generate", "--run", str(rr.run.root), "two words", "--prompt", "In the beginning...", "--prompts-file",
                 str(prompts), "--max-new-tokens", "2", "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.err.count("# path ") == 4
    starts = [out.out.index(p) for p in ("two words", "In the beginning...", "def f(x):", "int main")]
    assert starts == sorted(starts)
