import pytest

from dipaco.errors import DipacoError
from dipaco.model.grid import Grid, parse_grid


def test_parse_grid():
    assert parse_grid("2x2") == (2, 2)
    assert parse_grid("5") == (5,)
    for bad in ("0", "2x", "a", "2x0"):
        with pytest.raises(DipacoError):
            parse_grid(bad)


def test_paths_and_modules_of_a_2x2_grid():
    g = Grid.build("2x2", num_blocks=4)
    assert g.paths == ["0-0", "0-1", "1-0", "1-1"]
    assert g.level_blocks == ((0, 1), (2, 3))
    assert g.path_modules("1-0") == ["embed", "L0.E1", "L1.E0", "head"]
    assert set(g.modules) == {"embed", "head", "L0.E0", "L0.E1", "L1.E0", "L1.E1"}
    assert g.paths_through("L0.E1") == ["1-0", "1-1"]
    assert g.paths_through("embed") == g.paths
    assert g.module_components("L1.E1") == ["block.2", "block.3"]


def test_private_blocks_and_embedding():
    g = Grid.build("2x2", num_blocks=4, private_blocks=[0, 3], private_embedding=True)
    assert g.path_modules("0-1") == ["embed@0-1", "L0.E0", "B0@0-1", "L1.E1", "B3@0-1", "head"]
    assert g.module_components("L0.E0") == ["block.1"]
    assert g.paths_through("B0@0-1") == ["0-1"]
    assert len(g.modules) == 4 + 4 * 2 + 4 + 1  # private embeds, private blocks, level modules, head


def test_dense_and_flat_grids():
    assert Grid.build("1", 4).path_modules("0") == ["embed", "L0.E0", "head"]
    g = Grid.build("3", 4)
    assert g.paths == ["0", "1", "2"]
    assert g.module_components("L0.E2") == ["block.0", "block.1", "block.2", "block.3"]


def test_bad_level_splits_are_errors():
    with pytest.raises(DipacoError, match="level_sizes"):
        Grid.build("2x2", 4, level_sizes=[1, 2])
    with pytest.raises(DipacoError, match="only 2 blocks"):
        Grid.build("2x2x2", 2)
    with pytest.raises(DipacoError, match="out of range"):
        Grid.build("2", 4, private_blocks=[4])
    with pytest.raises(DipacoError, match="not on grid"):
        Grid.build("2x2", 4).path_modules("2-0")
