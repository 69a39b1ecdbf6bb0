import pytest

from dipaco.config import PRESETS, ShardConfig, TrainConfig, from_dict, parse_override, read_toml, resolve, to_dict, to_toml
from dipaco.errors import DipacoError


def test_precedence_defaults_preset_file_set_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('preset = "small"\nrounds = 3\n[inner]\nlr = 0.01\nbatch_size = 2\n')
    cfg = resolve(TrainConfig, f, ["inner.lr=0.02", "rounds=4"], {"rounds": 5, "inner_steps": None})
    assert cfg.preset == "small"
    assert cfg.model.hidden_size == PRESETS["small"]["model"]["hidden_size"]  # preset applied
    assert cfg.inner.batch_size == 2  # file beats preset
    assert cfg.inner.lr == 0.02  # --set beats file
    assert cfg.rounds == 5  # flag beats --set
    assert cfg.inner_steps == TrainConfig().inner_steps  # None flag leaves the default


def test_unknown_key_and_wrong_type_are_errors(tmp_path):
    with pytest.raises(DipacoError, match="unknown key 'inner.lrr'"):
        resolve(TrainConfig, overrides=["inner.lrr=1"])
    with pytest.raises(DipacoError, match="'rounds' must be int"):
        resolve(TrainConfig, overrides=['rounds="many"'])
    with pytest.raises(DipacoError, match="is a section"):
        resolve(TrainConfig, overrides=["inner=3"])
    with pytest.raises(DipacoError, match="must be > 0"):
        resolve(TrainConfig, overrides=["inner_steps=0"])
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = [\n")
    with pytest.raises(DipacoError, match="not valid TOML"):
        resolve(TrainConfig, bad)
    with pytest.raises(DipacoError, match="does not exist"):
        resolve(TrainConfig, tmp_path / "missing.toml")
    with pytest.raises(DipacoError, match="unknown preset"):
        resolve(TrainConfig, flags={"preset": "huge"})


def test_override_parsing():
    assert parse_override("a.b=3") == {"a": {"b": 3}}
    assert parse_override("grid.private_blocks=[0, 3]") == {"grid": {"private_blocks": [0, 3]}}
    assert parse_override("x=hello") == {"x": "hello"}  # not TOML: kept as a string
    with pytest.raises(DipacoError):
        parse_override("novalue")


@pytest.mark.parametrize("cls", [TrainConfig, ShardConfig])
def test_toml_round_trip(tmp_path, cls):
    cfg = resolve(cls)
    f = tmp_path / "c.toml"
    f.write_text(to_toml(cfg))
    assert to_dict(from_dict(cls, read_toml(f))) == to_dict(cfg)


def test_private_head_needs_an_untied_head():
    with pytest.raises(DipacoError, match="set model.tie_embeddings=false"):
        resolve(TrainConfig, overrides=["grid.private_head=true"])  # tied by default: the head is the embedding
    resolve(TrainConfig, overrides=["grid.private_head=true", "model.tie_embeddings=false"])
    resolve(TrainConfig, overrides=["grid.private_head=true", "grid.private_embedding=true"])  # tied, both private
