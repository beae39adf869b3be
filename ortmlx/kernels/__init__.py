"""ONNX op -> MLX translators, the registry and the eager interpreter.

Importing this package imports every family module, which registers its ops.
"""
from .registry import REGISTRY, register  # noqa: F401
from . import families  # noqa: F401,E402  (registers everything)
