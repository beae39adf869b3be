"""Loss ops against ORT's CPU EP: NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import TOL, check, rand, stays_on_cpu
from ortmlx.testing import check_against_cpu, make_model, session

CASES = [  # (op, input shape, reduction, ignore_index, with weight, n outputs, dtype)
    ("NegativeLogLikelihoodLoss", (3, 5), "mean", None, False, 1, T.FLOAT),
    ("NegativeLogLikelihoodLoss", (3, 5), "sum", None, True, 1, T.FLOAT),
    ("NegativeLogLikelihoodLoss", (3, 5, 2, 4), "none", None, True, 1, T.FLOAT),
    ("NegativeLogLikelihoodLoss", (3, 5, 4), "mean", 1, True, 1, T.FLOAT),
    ("NegativeLogLikelihoodLoss", (3, 5, 4), "mean", -1, False, 1, T.DOUBLE),
    ("NegativeLogLikelihoodLoss", (3, 5, 4), "none", 0, False, 1, T.DOUBLE),
    ("SoftmaxCrossEntropyLoss", (3, 5), "mean", None, False, 1, T.FLOAT),
    ("SoftmaxCrossEntropyLoss", (3, 5), "mean", None, True, 2, T.FLOAT),
    ("SoftmaxCrossEntropyLoss", (3, 5, 2, 3), "none", 2, True, 2, T.FLOAT),
    ("SoftmaxCrossEntropyLoss", (3, 5, 6), "sum", -5, False, 2, T.FLOAT),
    ("SoftmaxCrossEntropyLoss", (2, 4, 3), "mean", 3, True, 1, T.FLOAT),
]


def _model(op, shape, reduction, ii, weight, nout, t, tt=T.INT64):
    attrs = {"reduction": reduction}
    if ii is not None:
        attrs["ignore_index"] = ii
    ins = ["x", "t"] + (["w"] if weight else [])
    node = helper.make_node(op, ins, ["y", "lp"][:nout], **attrs)
    gin = [("x", t, shape), ("t", tt, (shape[0],) + shape[2:])] + ([("w", t, (shape[1],))] if weight else [])
    return make_model([node], gin, [("y", t, None), ("lp", t, None)][:nout])


def _feeds(shape, ii, weight, t, seed=0, tt=np.int64):
    rng = np.random.default_rng(seed)
    tgt = rng.integers(0, shape[1], (shape[0],) + shape[2:]).astype(tt)
    if ii is not None:
        tgt.reshape(-1)[::3] = ii                       # some targets ignored
    f = {"x": rand(shape, t, seed, -3, 3), "t": tgt}
    if weight:
        f["w"] = rand((shape[1],), t, seed + 1, 0.1, 2)
    return f


@pytest.mark.parametrize("op,shape,reduction,ii,weight,nout,t", CASES)
def test_loss(op, shape, reduction, ii, weight, nout, t):
    # two feeds on one session: targets are host values and must not be baked into a compiled graph
    r, a = TOL[t]
    check_against_cpu(_model(op, shape, reduction, ii, weight, nout, t),
                      [_feeds(shape, ii, weight, t), _feeds(shape, ii, weight, t, seed=1)], rtol=r, atol=a)


def test_loss_int32_targets():
    m = _model("SoftmaxCrossEntropyLoss", (4, 3), "mean", None, True, 1, T.FLOAT, T.INT32)
    check(m, _feeds((4, 3), None, True, T.FLOAT, tt=np.int32))


def test_target_out_of_range_is_an_error():
    m = _model("NegativeLogLikelihoodLoss", (3, 5), "mean", None, False, 1, T.FLOAT)
    f = _feeds((3, 5), None, False, T.FLOAT)
    f["t"][1] = 5
    with pytest.raises(Exception, match="out of range"):
        session(m).run(None, f)


def test_target_computed_on_device_is_synced():
    # a device-computed target is read on the host (an eager sync) and range-checked there
    nodes = [helper.make_node("ArgMax", ["x"], ["t"], axis=1, keepdims=0),
             helper.make_node("NegativeLogLikelihoodLoss", ["x", "t"], ["y"], reduction="sum")]
    m = make_model(nodes, [("x", T.FLOAT, (3, 5))], [("y", T.FLOAT, None)])
    import ortmlx
    from ortmlx.testing import check_against_cpu
    check_against_cpu(m, [{"x": rand((3, 5))}])
    assert any("NegativeLogLikelihoodLoss" in s for s in ortmlx.partition_reports()[-1].syncs)


def test_sce_float64_refused():
    m = _model("SoftmaxCrossEntropyLoss", (3, 5), "mean", None, False, 1, T.DOUBLE)
    stays_on_cpu(m, _feeds((3, 5), None, False, T.DOUBLE), "SoftmaxCrossEntropyLoss")
