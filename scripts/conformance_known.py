"""Known gaps of the ONNX backend node suite: case name -> reason (temporary xfails).

A case listed here may fail (status in conformance.FAILING) without failing CI.
The fix for a mismatch is a translator ``check`` that refuses the case; remove the
entry as soon as the case passes (tests/test_conformance.py fails on stale entries).
"""
ONNX_VERSION = "1.23.2"      # the onnx whose generated cases these names refer to

KNOWN_GAPS: dict[str, str] = {}
