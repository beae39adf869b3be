"""Known gaps of the ONNX backend node suite: case name -> reason (temporary xfails).

A case listed here may fail (status in conformance.FAILING) without failing CI.
The fix for a mismatch is a translator ``check`` that refuses the case; remove the
entry as soon as the case passes (tests/test_conformance.py fails on stale entries).
"""
ONNX_VERSION = "1.23.2"      # the onnx whose generated cases these names refer to

KNOWN_GAPS: dict[str, str] = {
    "test_attention_4d_causal_fp16_expanded": (
        "float16 rounding: with only Softmax claimed, 2 of 192 outputs differ from the reference by "
        "2 float16 ulps (rtol 1e-3); the Softmax translator already computes in float32 and rounds once, "
        "and the CPU EP itself fails the non-expanded twin (test_attention_4d_causal_fp16) by 1 element. "
        "Needs a look from the Softmax owner: match ORT's float16 Softmax or refuse float16 here"),
}
