"""cffi builder of ``ortmlx/_blasfwd*.so``: CBLAS entry points that forward to an optimized BLAS.

MLX's Linux CPU wheel links the reference BLAS (netlib) and calls ``cblas_sgemm`` /
``cblas_dgemm`` / ``cblas_cgemm`` through the dynamic linker. ``ortmlx.blas`` loads
this library with RTLD_GLOBAL *before* ``mlx.core``, so those three names bind here
(the global scope is searched before libmlx's own dependencies); ``ortmlx_blas_bind``
points them at the optimized library's functions (scipy-openblas32's ``scipy_cblas_*``).
No link-time dependency: the target addresses are set at run time.
"""
import sys

from cffi import FFI

SRC = r"""
#include <stddef.h>
typedef void (*ortmlx_sgemm_t)(int, int, int, int, int, int, float, const float*, int,
                               const float*, int, float, float*, int);
typedef void (*ortmlx_dgemm_t)(int, int, int, int, int, int, double, const double*, int,
                               const double*, int, double, double*, int);
typedef void (*ortmlx_cgemm_t)(int, int, int, int, int, int, const void*, const void*, int,
                               const void*, int, const void*, void*, int);
static ortmlx_sgemm_t p_s = NULL;
static ortmlx_dgemm_t p_d = NULL;
static ortmlx_cgemm_t p_c = NULL;
static unsigned long long n_calls = 0;

int ortmlx_blas_bind(void* s, void* d, void* c) {
    if (s == NULL || d == NULL || c == NULL) return -1;
    p_s = (ortmlx_sgemm_t)s; p_d = (ortmlx_dgemm_t)d; p_c = (ortmlx_cgemm_t)c;
    return 0;
}
unsigned long long ortmlx_blas_calls(void) { return n_calls; }

__attribute__((visibility("default")))
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
    __atomic_add_fetch(&n_calls, 1, __ATOMIC_RELAXED);
    p_s(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
__attribute__((visibility("default")))
void cblas_dgemm(int o, int ta, int tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
    __atomic_add_fetch(&n_calls, 1, __ATOMIC_RELAXED);
    p_d(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
__attribute__((visibility("default")))
void cblas_cgemm(int o, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int lda,
                 const void* b, int ldb, const void* beta, void* c, int ldc) {
    __atomic_add_fetch(&n_calls, 1, __ATOMIC_RELAXED);
    p_c(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""

ffibuilder = FFI()
ffibuilder.cdef("int ortmlx_blas_bind(void* s, void* d, void* c);\nunsigned long long ortmlx_blas_calls(void);")
ffibuilder.set_source("ortmlx._blasfwd", SRC)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=sys.argv[1] if len(sys.argv) > 1 else ".", verbose=True)
