import pytest
import torch

from dipaco.config import ModelConfig
from dipaco.model.grid import Grid
from dipaco.model.path_model import PathModel, component_of, init_modules, llama_config

CFG = llama_config(ModelConfig(hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=2, intermediate_size=64,
                               max_seq_len=32), vocab_size=300, eos_token_id=0)


def test_component_of():
    assert component_of("model.embed_tokens.weight") == "embed"
    assert component_of("model.layers.3.mlp.up_proj.weight") == "block.3"
    assert component_of("model.norm.weight") == "head" and component_of("lm_head.weight") == "head"


def test_what_a_private_head_and_embedding_hold():
    untied = llama_config(ModelConfig(hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=2, intermediate_size=64,
                                      max_seq_len=32, tie_embeddings=False), vocab_size=300, eos_token_id=0)
    pm = PathModel(Grid.build("2x2", 4, private_head=True), "0-1", untied)
    assert pm.module_params["head@0-1"] == ["model.norm.weight", "lm_head.weight"]
    assert pm.module_params["embed"] == ["model.embed_tokens.weight"]
    # tied: the head weight is the embedding, so a private embedding carries it and "head" is the norm alone
    pm = PathModel(Grid.build("2x2", 4, private_embedding=True, private_head=True), "0-1", CFG)
    assert pm.module_params["embed@0-1"] == ["model.embed_tokens.weight"]
    assert pm.module_params["head@0-1"] == ["model.norm.weight"]
    assert pm.model.lm_head.weight is pm.params["model.embed_tokens.weight"]


def test_modules_cover_every_parameter_exactly_once():
    grid = Grid.build("2x2", 4, private_blocks=[0])
    pm = PathModel(grid, "1-0", CFG)
    names = [n for ns in pm.module_params.values() for n in ns]
    assert sorted(names) == sorted(pm.params)  # tied head: the embedding is listed once


def test_shared_modules_are_the_same_tensors_in_every_path():
    grid = Grid.build("2x2", 4)
    modules = init_modules(grid, CFG, seed=0)
    assert set(modules) == set(grid.modules)  # one stored copy per module, shared or not
    a, b = PathModel(grid, "0-0", CFG), PathModel(grid, "0-1", CFG)
    a.load_modules(modules)
    b.load_modules(modules)
    for name in a.module_params["L0.E0"] + a.module_params["embed"]:  # shared by both paths
        assert torch.equal(a.params[name], b.params[name])
    # the path model's parameter views write through to its own model only
    with torch.no_grad():
        a.params["model.norm.weight"].add_(1.0)
    assert not torch.equal(a.params["model.norm.weight"], b.params["model.norm.weight"])
    assert torch.equal(a.module_tensors("head")["model.norm.weight"], a.model.model.norm.weight)


def test_path_model_runs_and_modules_read_back():
    grid = Grid.build("2", 4)
    modules = init_modules(grid, CFG, seed=1)
    pm = PathModel(grid, "1", CFG)
    pm.load_modules(modules)
    out = pm.model(input_ids=torch.randint(0, 300, (2, 16))).logits
    assert out.shape == (2, 16, 300)
    for m in pm.modules:
        for n, t in pm.module_tensors(m).items():
            assert torch.equal(t, modules[m][n])


@pytest.mark.slow
def test_private_untied_head_trains_per_path_and_exports(shards_2x2, tmp_path):
    """grid.private_head with model.tie_embeddings=false: every path has its own lm_head after training, and an
    exported path loads in plain transformers with that head."""
    from transformers import AutoModelForCausalLM

    from dipaco.eval.api import load
    from dipaco.storage import checkpoint
    from dipaco.training.train import train

    from conftest import tiny_train_config

    run = tmp_path / "run"
    train(tiny_train_config("grid.private_head=true", "model.tie_embeddings=false", "val_batches=0", rounds=1,
                            inner_steps=3), shards_2x2, run, progress=False)
    start, end = checkpoint.load_modules(run, 0), checkpoint.load_modules(run, 1)
    heads = [f"head@{p}" for p in ("0-0", "0-1", "1-0", "1-1")]
    assert all(torch.equal(start[h]["lm_head.weight"], start[heads[0]]["lm_head.weight"]) for h in heads)  # one start
    for i, a in enumerate(heads):
        for b in heads[i + 1:]:
            assert not torch.equal(end[a]["lm_head.weight"], end[b]["lm_head.weight"]), (a, b)
    assert "lm_head.weight" not in end["embed"]
    rr = load(run)
    rr.export("0-1", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, end["head@0-1"]["lm_head.weight"])
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, rr.path_model("0-1").model(input_ids=ids).logits)
