from setuptools import setup

# cffi compiles the embedding-mode shim ortmlx.ep._shim (exports CreateEpFactories/ReleaseEpFactory).
setup(cffi_modules=["ortmlx/ep/_build_shim.py:ffibuilder"])
