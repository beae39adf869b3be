"""Options and the errors a user reads: one line naming the option (or node) and the valid values, no traceback;
ORT's fallback to the CPU EP made fatal with ``enable_fallback=0``; the command line's exit status."""
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import ortmlx
from ortmlx.ep.options import COMPILE_PATHS, EpOptions, OptionError
from ortmlx.testing import make_model, session
from ortmlx.tuning import Tuning, TuningError


def model():
    nodes = [h.make_node("Add", ["X", "X"], ["a"]), h.make_node("Relu", ["a"], ["Y"])]
    return make_model(nodes, [("X", T.FLOAT, ["N", 4])], [("Y", T.FLOAT, ["N", 4])])


def strict_session(opts, env=None, monkeypatch=None):
    """A session that raises when the MLX EP cannot be created (no silent CPU-EP session)."""
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    ortmlx.register(genai=False)
    return ort.InferenceSession(model().SerializeToString(), providers=[("MLXExecutionProvider", opts)],
                                enable_fallback=0)


# (provider options, environment, what the one line must say)
BAD = [
    ({"devise": "cpu"}, {}, "unknown option 'devise' (did you mean 'device'?); options: device, no_compile"),
    ({"device": "tpu"}, {}, "option device='tpu': valid values are auto, cpu, gpu"),
    ({"no_compile": "maybe"}, {}, "option no_compile='maybe': valid values are 1 (all), 0, or a list of general"),
    ({"no_compile": "decode,typo"}, {}, "option no_compile='decode,typo'"),
    ({"verbose": "sometimes"}, {}, "option verbose='sometimes': valid values are 1, true, on, yes or 0"),
    ({"no_decode_compile": "2"}, {}, "option no_decode_compile='2'"),
    ({"disable_ops": "Relu,NotAnOp"}, {}, "option disable_ops: 'NotAnOp' is not an op type the MLX EP runs"),
    ({"disable_ops": "Rleu"}, {}, "(did you mean 'Relu'?)"),
    ({"cuda_kernels": "0"}, {}, "unknown option 'cuda_kernels' (a tuning knob: tuning=\"cuda_kernels=...\")"),
    ({"tuning": "cuda_kernel=0"}, {}, "option tuning: unknown key 'cuda_kernel'; keys: kv_mirror"),
    ({"tuning": "fold_mlp=maybe"}, {}, "option tuning: fold_mlp='maybe': valid values are 0, 1"),
    ({"tuning": "compile_mode=fast"}, {}, "compile_mode='fast': valid values are enabled, no_fuse"),
    ({}, {"ORTMLX_DEVICE": "npu"}, "option device='npu'"),
    ({}, {"ORTMLX_NO_COMPILE": "yes please"}, "option no_compile='yes please'"),
    ({}, {"ORTMLX_TUNING": "call_ahead"}, "ORTMLX_TUNING: 'call_ahead' needs a value"),
    ({}, {"ORTMLX_DISABLE_OPS": "Foo"}, "'Foo' is not an op type"),
]


@pytest.mark.parametrize("opts,env,msg", BAD, ids=[repr(b[0] or b[1]) for b in BAD])
def test_bad_option_is_one_line_and_fatal_without_fallback(monkeypatch, capfd, opts, env, msg):
    with pytest.raises(Exception) as ei:
        strict_session(opts, env, monkeypatch)
    text = str(ei.value)
    out = capfd.readouterr()
    assert msg in text, text
    ours = text[text.index("MLXExecutionProvider CreateEp:"):]
    assert "\n" not in ours.strip() and "Traceback" not in text + out.err + out.out, (text, out.err)


def test_bad_option_falls_back_to_the_cpu_ep_by_default(capfd):
    """ORT's Python layer retries on the CPU EP when an EP cannot be created (the README says so): the session
    runs, printing our one line inside ORT's banner."""
    ortmlx.register(genai=False)
    s = ort.InferenceSession(model().SerializeToString(), providers=[("MLXExecutionProvider", {"device": "tpu"})])
    out = capfd.readouterr().out
    assert s.get_providers() == ["CPUExecutionProvider"]
    assert "option device='tpu': valid values are auto, cpu, gpu" in out and "Traceback" not in out


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                      ("false", False), ("off", False), ("no", False), ("", False)])
def test_switch_values(value, on):
    assert EpOptions.from_sources({"verbose": value}, {}).verbose is on


@pytest.mark.parametrize("provider,env,off", [
    ({}, {}, set()),
    ({"no_compile": "1"}, {}, set(COMPILE_PATHS)),
    ({"no_compile": "all"}, {}, set(COMPILE_PATHS)),
    ({"no_compile": "decode, prefill"}, {}, {"decode", "prefill"}),
    ({"no_compile": "0"}, {"ORTMLX_NO_COMPILE": "1"}, set()),          # the provider option wins
    ({}, {"ORTMLX_NO_COMPILE": "general"}, {"general"}),
    ({}, {"ONNX_GENAI_MLX_NO_COMPILE": "1"}, set(COMPILE_PATHS)),
    ({"no_prefill_compile": "1"}, {}, {"prefill"}),                     # earlier releases' kill switches
    ({}, {"MLX_EP_NO_GENERAL_COMPILE": "1", "ORTMLX_NO_DECODE_COMPILE": "on"}, {"general", "decode"}),
    ({"no_compile": "general", "no_decode_compile": "1"}, {}, {"general", "decode"}),
])
def test_no_compile_paths_and_aliases(provider, env, off):
    o = EpOptions.from_sources(provider, env)
    assert o.no_compile == frozenset(off)
    assert [o.compiles(p) for p in COMPILE_PATHS] == [p not in off for p in COMPILE_PATHS]
    assert o.compile_enabled == (off != set(COMPILE_PATHS))


def test_empty_values_are_unset_or_off():
    o = EpOptions.from_sources({}, {"ORTMLX_DEVICE": " ", "ORTMLX_TRACE": "", "ORTMLX_TUNING": ""})
    assert (o.device, o.trace, o.tuning) == ("auto", "", Tuning())
    o = EpOptions.from_sources({"device": ""}, {"ORTMLX_DEVICE": "cpu"})
    assert o.device == "auto"                                     # the provider's (empty) value: the default


def test_tuning_provider_over_environment_key_by_key():
    o = EpOptions.from_sources({"tuning": "fold_mlp=0,call_ahead=1"},
                               {"ORTMLX_TUNING": "fold_mlp=1,cuda_kernels=off,compile_mode=no_fuse"})
    t = o.tuning
    assert (t.fold_mlp, t.call_ahead, t.cuda_kernels, t.compile_mode) == (False, True, False, "no_fuse")
    assert t.describe() == "cuda_kernels=0,fold_mlp=0,compile_mode=no_fuse,call_ahead=1"
    assert Tuning.parse(t.describe()) == t                        # describe() is a tuning string
    assert Tuning.parse("lift_weights=auto,blas_threads=3") == Tuning(lift_weights=None, blas_threads=3)
    with pytest.raises(TuningError, match="blas_threads='0': a positive integer or auto"):
        Tuning.parse("blas_threads=0")


def test_process_wide_tuning_keys_only_from_the_environment():
    """A process-wide knob in the provider option would be ignored: it is refused, naming where it goes."""
    from ortmlx.tuning import ENV_ONLY
    assert ENV_ONLY <= set(Tuning.__dataclass_fields__)
    with pytest.raises(OptionError, match="option tuning: 'byte_copies' is process-wide, read from the environment "
                                          "only: set it in ORTMLX_TUNING"):
        EpOptions.from_sources({"tuning": "fold_mlp=0, byte_copies=0"}, {})
    assert not EpOptions.from_sources({}, {"ORTMLX_TUNING": "byte_copies=0"}).tuning.byte_copies


def test_retired_environment_variable_warns_once(monkeypatch):
    from ortmlx.ep import options
    monkeypatch.setattr(options, "_warned", set())
    with pytest.warns(RuntimeWarning, match="ORTMLX_CUDA_KERNELS is no longer read: use ORTMLX_TUNING=cuda_kernels=0"):
        EpOptions.from_sources({}, {"ORTMLX_CUDA_KERNELS": "0"})
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EpOptions.from_sources({}, {"ORTMLX_CUDA_KERNELS": "0"})   # once per process


def test_option_error_is_a_user_error():
    with pytest.raises(OptionError) as ei:
        EpOptions.from_sources({"device": "tpu"}, {})
    assert isinstance(ei.value, ValueError) and ei.value.code == 2    # ORT_INVALID_ARGUMENT


def reshape_model():
    nodes = [h.make_node("Reshape", ["x", "s"], ["y"], name="rs"), h.make_node("Relu", ["y"], ["z"])]
    return make_model(nodes, [("x", T.FLOAT, [2, 3]), ("s", T.INT64, [2])], [("z", T.FLOAT, None)])


def test_compute_error_is_one_line_naming_the_node(capfd):
    s = session(reshape_model())
    with pytest.raises(Exception) as ei:
        s.run(None, {"x": np.ones((2, 3), np.float32), "s": np.array([4, 4], np.int64)})
    text = str(ei.value)
    out = capfd.readouterr()
    ours = text[text.index("MLXExecutionProvider Compute"):]
    assert "Reshape 'rs'" in ours and "cannot reshape input of shape (2, 3) to [4, 4]" in ours, ours
    assert "(at ortmlx/kernels/ops/shape.py:" in ours                # where it was raised
    assert "\n" not in ours.strip() and "Traceback" not in text + out.err + out.out, out.err
    good = s.run(None, {"x": np.ones((2, 3), np.float32), "s": np.array([3, 2], np.int64)})[0]
    np.testing.assert_array_equal(good, np.ones((3, 2), np.float32))  # the session survives


def test_internal_error_shows_its_traceback_once(capfd, monkeypatch):
    """A bug of ours (an exception of no reported kind) is one line in the status, its traceback once on stderr."""
    from ortmlx.runtime.group import Group

    def broken(self, *a, **k):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(Group, "write", broken)
    s = session(model())
    with pytest.raises(Exception) as ei:
        s.run(None, {"X": np.ones((1, 4), np.float32)})
    text = str(ei.value)
    err = capfd.readouterr().err
    assert "internal error, ZeroDivisionError: a bug" in text and "(traceback on stderr)" in text, text
    assert "Traceback" not in text and err.count("Traceback (most recent call last)") == 1, err
    assert "in broken" in err


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ortmlx", *args], capture_output=True, text=True, timeout=120)


def test_cli_version():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"ortmlx {ortmlx.__version__} (mlx "), r.stdout + r.stderr


def test_cli_check_fails_when_the_session_cannot_be_made(tmp_path):
    good = tmp_path / "m.onnx"
    good.write_bytes(model().SerializeToString())
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    r = _cli("check", str(good), "--device", "cpu")
    assert r.returncode == 0 and "2/2 nodes on MLX" in r.stdout, r.stdout + r.stderr
    hint = "hint: on a Linux CPU ORT's own CPU EP runs most models faster"
    assert (hint in r.stdout) == sys.platform.startswith("linux"), r.stdout     # said where it holds
    r = _cli("check", str(good), "-o", "disable_ops=Relu")
    assert r.returncode == 0 and "1/2 nodes on MLX" in r.stdout and "disabled" in r.stdout, r.stdout
    for args, msg in (((str(bad),), "INVALID_PROTOBUF"), ((str(tmp_path / "none.onnx"),), "no such file"),
                      ((str(good), "-o", "device=tpu"), "option device='tpu': valid values are auto, cpu, gpu")):
        r = _cli("check", *args)
        assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_check_time_says_which_ep_is_faster(tmp_path):
    """`check --time`: a line per EP with its median, the answers' difference, and a hint that names the
    faster EP with the ratio of the printed times (the hint is derived, so it must agree with them)."""
    import re
    good = tmp_path / "m.onnx"
    good.write_bytes(model().SerializeToString())
    r = _cli("check", str(good), "--time", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    ms = dict(re.findall(r"^  (\w+ExecutionProvider)\s+([0-9.]+) ms", r.stdout, re.M))
    assert "MLXExecutionProvider" in ms and "CPUExecutionProvider" in ms, r.stdout
    assert re.search(r"max \|MLX EP - CPUExecutionProvider\| 0\b", r.stdout), r.stdout    # Add + Relu: exact
    mlx, cpu = float(ms["MLXExecutionProvider"]), float(ms["CPUExecutionProvider"])
    hint = re.search(r"^hint: on this machine (.+) runs this model ([0-9.]+)x faster than (.+?)( \(|$)", r.stdout, re.M)
    assert hint, r.stdout
    faster, ratio = hint.group(1), float(hint.group(2))
    if "CUDAExecutionProvider" not in ms:
        assert faster == ("CPUExecutionProvider" if mlx > cpu else "the MLX EP"), r.stdout
        want = mlx / cpu if mlx > cpu else cpu / mlx
        assert abs(ratio - want) <= 0.0051, (ratio, want, r.stdout)    # only the hint's own rounding


def test_cli_check_time_names_an_input_it_cannot_make(tmp_path):
    nodes = [h.make_node("Add", ["X", "X"], ["a"]), h.make_node("Relu", ["a"], ["Y"]),
             h.make_node("Identity", ["S"], ["Z"])]
    m = make_model(nodes, [("X", T.FLOAT, [1, 4]), ("S", T.STRING, [1])], [("Y", T.FLOAT, [1, 4]), ("Z", T.STRING, [1])])
    path = tmp_path / "s.onnx"
    path.write_bytes(m.SerializeToString())
    r = _cli("check", str(path), "--time", "--device", "cpu")
    assert r.returncode == 1 and "input 'S' is a tensor(string)" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_option_without_a_value_is_one_line(tmp_path):
    good = tmp_path / "m.onnx"
    good.write_bytes(model().SerializeToString())
    r = _cli("check", str(good), "-o", "no_compile")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "ortmlx check: -o 'no_compile': give key=value (e.g. -o no_compile=1)", r.stderr
