"""Issue 2: whole small models on MLX, equal to the CPU EP over several shapes on one session."""
import numpy as np
import pytest

from ortmlx.testing import check_against_cpu

from models_basic import cnn, mlp, transformer_block

rng = np.random.default_rng(1)


def feeds(name, shapes):
    return [{name: rng.standard_normal(s).astype(np.float32)} for s in shapes]


CASES = {
    "mlp": (mlp, "X", [(1, 16), (5, 16), (0, 16), (33, 16)]),
    "cnn": (cnn, "X", [(1, 3, 16, 16), (2, 3, 16, 16), (0, 3, 16, 16)]),
    "transformer_block": (transformer_block, "X", [(1, 7, 32), (2, 3, 32), (0, 5, 32), (3, 1, 32)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_all_on_mlx_and_equal(case):
    build, name, shapes = CASES[case]
    check_against_cpu(build(), feeds(name, shapes), rtol=1e-4, atol=1e-5)
