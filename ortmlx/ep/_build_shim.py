"""cffi builder of ``ortmlx/ep/_shim*.so``: the library ORT loads.

Embedding mode: it exports ``CreateEpFactories`` / ``ReleaseEpFactory``, which
run Python (``ortmlx.ep.callbacks``) inside the host process's interpreter.
"""
import os
import sys

from cffi import FFI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cdef as _c  # noqa: E402  (imported by path: the package is not built yet)

ffibuilder = FFI()
ffibuilder.cdef(_c.cdef())
ffibuilder.embedding_api(_c.EXPORTS)
ffibuilder.set_source(
    "ortmlx.ep._shim",
    "#ifndef _GNU_SOURCE\n#define _GNU_SOURCE\n#endif\n"
    "#include <stdint.h>\n#include <stddef.h>\n#include <stdbool.h>\n" + _c.c_types() + _c.HELPERS_SRC,
)
ffibuilder.embedding_init_code("""
from ortmlx.ep._shim import ffi, lib
from ortmlx.ep import callbacks
callbacks.install(ffi, lib)
""")

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=sys.argv[1] if len(sys.argv) > 1 else ".", verbose=True)
