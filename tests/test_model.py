import torch

from dipaco.config import ModelConfig
from dipaco.grid import Grid
from dipaco.model import PathModel, component_of, init_modules, llama_config

CFG = llama_config(ModelConfig(hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=2, intermediate_size=64,
                               max_seq_len=32), vocab_size=300, eos_token_id=0)


def test_component_of():
    assert component_of("model.embed_tokens.weight") == "embed"
    assert component_of("model.layers.3.mlp.up_proj.weight") == "block.3"
    assert component_of("model.norm.weight") == "head"


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
