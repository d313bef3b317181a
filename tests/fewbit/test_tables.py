import json

import pytest

from hf_actq.fewbit import ACTIVATIONS, shipped_tables, table_for
from hf_actq.fewbit.build_tables import build, shipped_table_names
from hf_actq.fewbit.tables import SHIPPED_SETTINGS, TABLES_PATH


def test_every_table_activation_ships_tables_for_1_to_4_bits_with_their_error():
    tables = shipped_tables()
    for name in shipped_table_names():
        for bits in (1, 2, 3, 4):
            table = tables[(name, bits)]
            assert len(table.levels) == 2**bits and len(table.borders) == 2**bits - 1
            assert table.error > 0
            assert list(table.borders) == sorted(table.borders)


def test_shipped_settings_are_recorded():
    data = json.loads(TABLES_PATH.read_text())
    assert data["settings"]["interval"] == list(SHIPPED_SETTINGS["interval"])
    assert data["settings"]["num_points"] == SHIPPED_SETTINGS["num_points"]


@pytest.mark.parametrize("name", ["gelu", "sigmoid"])
def test_regenerating_a_sample_reproduces_the_shipped_tables(name):
    rebuilt = build([name])["tables"][name]
    shipped = shipped_tables()
    for bits, table in rebuilt.items():
        expected = shipped[(name, int(bits))]
        assert tuple(table["borders"]) == expected.borders
        assert tuple(table["levels"]) == pytest.approx(expected.levels, rel=1e-12, abs=1e-15)
        assert table["error"] == pytest.approx(expected.error, rel=1e-9)


def test_aliases_share_tables():
    assert table_for("gelu_new", 3) is table_for("gelu_pytorch_tanh", 3)
    assert table_for("swish", 2) is table_for("silu", 2)


@pytest.mark.parametrize("name", [n for n, s in ACTIVATIONS.items() if s.exact is not None])
def test_two_valued_derivatives_get_exact_one_bit_tables(name):
    for bits in (1, 3):
        table = table_for(name, bits)
        assert table.bits == 1 and table.error == 0.0 and len(table.levels) == 2


def test_non_default_parameters_compute_a_table_once():
    first = table_for("elu", 2, alpha=0.5)
    assert first is table_for("elu", 2, alpha=0.5)
    assert first.params == {"alpha": 0.5}
    assert first.levels != table_for("elu", 2).levels
