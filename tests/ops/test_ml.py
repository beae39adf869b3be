"""ai.onnx.ml basics against ORT's CPU EP."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import check, rand, stays_on_cpu
from ortmlx.testing import make_model, session

ML = {"ai.onnx.ml": 3}
NPT = {T.FLOAT: np.float32, T.DOUBLE: np.float64, T.INT64: np.int64, T.INT32: np.int32}


def _one(op, t_in, shape, t_out, attrs, extra_inputs=(), inits=None):
    node = helper.make_node(op, ["x", *[n for n, _, _ in extra_inputs]], ["y"], domain="ai.onnx.ml", **attrs)
    gin = [("x", t_in, shape)] + [i for i in extra_inputs if not (inits and i[0] in inits)]
    return make_model([node], gin, [("y", t_out, None)], inits or {}, extra_opsets=ML)


def _x(t, shape, seed=0):
    if t in (T.INT64, T.INT32):
        return np.random.default_rng(seed).integers(-5, 6, shape).astype(NPT[t])
    return rand(shape, t, seed, -3, 3)


CASES = [  # (op, input dtype, shape, output dtype, attrs)
    ("Binarizer", T.FLOAT, (3, 4), T.FLOAT, {"threshold": 0.5}),
    ("Binarizer", T.FLOAT, (5,), T.FLOAT, {}),
    ("Scaler", T.FLOAT, (3, 4), T.FLOAT, {"offset": [0.5, -1.0, 2.0, 0.0], "scale": [2.0, 0.5, -1.0, 3.0]}),
    ("Scaler", T.INT64, (3, 4), T.FLOAT, {"offset": [1.5], "scale": [0.25]}),
    ("Scaler", T.DOUBLE, (4,), T.FLOAT, {"offset": [0.0], "scale": [2.0]}),
    ("Scaler", T.INT32, (2, 3), T.FLOAT, {"offset": [1.0, 0.0, -2.0], "scale": [0.5, 2.0, 1.0]}),
    ("Normalizer", T.FLOAT, (3, 4), T.FLOAT, {"norm": "L2"}),
    ("Normalizer", T.FLOAT, (3, 4), T.FLOAT, {"norm": "L1"}),
    ("Normalizer", T.FLOAT, (3, 4), T.FLOAT, {"norm": "MAX"}),
    ("Normalizer", T.INT64, (2, 5), T.FLOAT, {"norm": "L2"}),
    ("Normalizer", T.DOUBLE, (4,), T.FLOAT, {"norm": "L1"}),
    ("Imputer", T.FLOAT, (3, 4), T.FLOAT, {"imputed_value_floats": [9.0], "replaced_value_float": float("nan")}),
    ("Imputer", T.FLOAT, (3, 4), T.FLOAT, {"imputed_value_floats": [1.0, 2.0, 3.0, 4.0],
                                           "replaced_value_float": 0.0}),
    ("Imputer", T.INT64, (3, 4), T.INT64, {"imputed_value_int64s": [7, 8, 9, 10], "replaced_value_int64": 2}),
]


@pytest.mark.parametrize("op,t,shape,tout,attrs", CASES)
def test_ml(op, t, shape, tout, attrs):
    x = _x(t, shape)
    if op == "Imputer" and t == T.FLOAT:
        x.reshape(-1)[::3] = np.nan if np.isnan(attrs["replaced_value_float"]) else 0.0
    if op == "Binarizer":
        x.reshape(-1)[::4] = attrs.get("threshold", 0.0)            # values at the threshold
    check(_one(op, t, shape, tout, attrs), {"x": x})


@pytest.mark.parametrize("t,shape,idx", [(T.FLOAT, (3, 5), [0, 4, 2]), (T.INT64, (2, 3, 4), [3, 3]),
                                         (T.FLOAT, (6,), [1, 5]), (T.INT32, (2, 4), [[1, 0]])])
def test_array_feature_extractor(t, shape, idx):
    i = np.array(idx, np.int64)
    m = _one("ArrayFeatureExtractor", t, shape, t, {}, [("i", T.INT64, i.shape)])
    check(m, {"x": _x(t, shape), "i": i})


def test_array_feature_extractor_bad_index_is_an_error():
    m = _one("ArrayFeatureExtractor", T.FLOAT, (2, 3), T.FLOAT, {}, [("i", T.INT64, (1,))])
    with pytest.raises(Exception, match="out of range"):
        session(m).run(None, {"x": _x(T.FLOAT, (2, 3)), "i": np.array([3], np.int64)})


LE = [  # (ml opset, input dtype, output dtype, attrs)
    (2, T.INT64, T.INT64, {"keys_int64s": [5, 1, 3], "values_int64s": [10, 20, 30]}),
    (2, T.INT64, T.FLOAT, {"keys_int64s": [5, 1, 3], "values_floats": [0.5, 1.5, 2.5], "default_float": 9.0}),
    (2, T.FLOAT, T.INT64, {"keys_floats": [0.0, 1.5, -2.0], "values_int64s": [7, 8, 9], "default_int64": 42}),
    (2, T.FLOAT, T.FLOAT, {"keys_floats": [1.0, 2.0], "values_floats": [-1.0, -2.0]}),
    (4, T.INT64, T.INT64, {"keys_tensor": helper.make_tensor("k", T.INT64, [3], [2, 4, 6]),
                           "values_tensor": helper.make_tensor("v", T.INT64, [3], [1, 2, 3]),
                           "default_tensor": helper.make_tensor("d", T.INT64, [1], [-5])}),
    (4, T.INT64, T.INT64, {"keys_int64s": [1, 2], "values_int64s": [3, 4]}),
]


@pytest.mark.parametrize("opset,t,tout,attrs", LE)
def test_label_encoder(opset, t, tout, attrs):
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", **attrs)
    m = make_model([node], [("x", t, (3, 4))], [("y", tout, None)], extra_opsets={"ai.onnx.ml": opset})
    rng = np.random.default_rng(0)
    if t == T.INT64:
        x = rng.integers(0, 7, (3, 4)).astype(np.int64)
    else:
        x = rng.choice(np.array([0.0, -0.0, 1.5, -2.0, 1.0, 2.0, 3.25, np.nan], np.float32), (3, 4))
    check(m, {"x": x})


@pytest.mark.parametrize("t,shape", [(T.INT64, (3, 4)), (T.INT64, (5,)), (T.INT64, (2, 1))])
def test_one_hot_encoder(t, shape):
    m = _one("OneHotEncoder", t, shape, T.FLOAT, {"cats_int64s": [4, 1, 0, -2]})
    check(m, {"x": _x(t, shape)})


FV = [  # (input dtypes and shapes, inputdimensions)
    ([(T.FLOAT, (3, 2)), (T.FLOAT, (3, 4))], [2, 4]),
    ([(T.INT64, (2, 5)), (T.INT64, (2, 2)), (T.INT64, (2, 3))], [3, 2, 5]),     # cut to 3, padded to 5
    ([(T.DOUBLE, (2, 2)), (T.DOUBLE, (2, 3))], [2, 3]),
    ([(T.FLOAT, (4, 1))], [1]),
]


@pytest.mark.parametrize("ins,dims", FV)
def test_feature_vectorizer(ins, dims):
    names = [f"x{k}" for k in range(len(ins))]
    node = helper.make_node("FeatureVectorizer", names, ["y"], domain="ai.onnx.ml", inputdimensions=dims)
    m = make_model([node], [(n, t, s) for n, (t, s) in zip(names, ins)], [("y", T.FLOAT, None)], extra_opsets=ML)
    check(m, {n: _x(t, s, k) for k, (n, (t, s)) in enumerate(zip(names, ins))})


def test_one_hot_encoder_zeros0_refused():
    m = _one("OneHotEncoder", T.INT64, (2, 3), T.FLOAT, {"cats_int64s": [0, 1, 2, 3, 4, 5, -1, -2, -3, -4, -5],
                                                          "zeros": 0})
    stays_on_cpu(m, {"x": _x(T.INT64, (2, 3))}, "OneHotEncoder")
