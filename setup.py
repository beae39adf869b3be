from setuptools import setup

# cffi compiles the embedding-mode shim ortmlx.ep._shim (exports CreateEpFactories/ReleaseEpFactory)
# and ortmlx._blasfwd (CBLAS forwarders to an optimized BLAS for MLX's Linux CPU wheel: ortmlx/blas.py).
setup(cffi_modules=["ortmlx/ep/_build_shim.py:ffibuilder", "ortmlx/_build_blas.py:ffibuilder"])
