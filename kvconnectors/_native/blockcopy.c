/* kvconnectors._blockcopy: the shm pull's per-block loop (copy a slot, check its xxh3) in C, and the
 * check alone (after a nixl READ), and the stager's row checksums.
 *
 * Why native (issue #15 item 9): in Python each 64 KiB block costs a ctypes memmove and an xxh3 call,
 * and xxhash's binding holds the GIL while it hashes, so two copying threads take turns instead of
 * running side by side. Here a whole share runs without the GIL.
 *
 * Why streaming stores: a regular store first reads the destination line (read for ownership), so a
 * copy moves three bytes per byte copied; non-temporal stores skip that read, a third less memory
 * traffic, and the copy is not bound to the cache. The destination is then not in cache, so the
 * checksum is taken of the source slot, which the copy has just read into cache: the same bytes
 * (the producer keeps a slot pinned, unchanged, until the consumer's answer).
 *
 * xxHash (xxhash.h, BSD 2-Clause, Yann Collet) is vendored unchanged, version 0.8.2: XXH3_64bits
 * with seed 0 is python-xxhash's xxh3_64_intdigest, what the producer seals entries with.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

/* Copy n bytes with streaming stores where the destination allows it (16-byte aligned, whole
 * 64-byte lines). Returns whether it did (else it copied with memcpy, leaving d in cache). */
static int copy_slot(char *d, const char *s, size_t n) {
#if HAVE_STREAM
    if ((((uintptr_t)d) & 15) == 0 && (n & 63) == 0) {
        for (size_t o = 0; o < n; o += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
            _mm_stream_si128((__m128i *)(d + o), a);
            _mm_stream_si128((__m128i *)(d + o + 16), b);
            _mm_stream_si128((__m128i *)(d + o + 32), c);
            _mm_stream_si128((__m128i *)(d + o + 48), e);
        }
        return 1;
    }
#endif
    memcpy(d, s, n);
    return 0;
}

/* Blocks start..stop: dst[i] <- src + offs[i] (slot bytes each); with sums, the first i whose xxh3
 * differs from sums[i] (copying stops there), else -1. */
static int64_t copy_verify(const char *src, const int64_t *offs, const uint64_t *dst, const uint64_t *sums,
                           int64_t start, int64_t stop, size_t slot) {
    int64_t bad = -1;
    for (int64_t i = start; i < stop; i++) {
        char *d = (char *)(uintptr_t)dst[i];
        const char *s = src + offs[i];
        int streamed = copy_slot(d, s, slot);
        /* the source while it is in cache after a streamed copy, else the destination (in cache) */
        if (sums && XXH3_64bits(streamed ? (const void *)s : (const void *)d, slot) != sums[i]) {
            bad = i;
            break;
        }
    }
#if HAVE_STREAM
    _mm_sfence();  /* streamed stores are visible before the caller reports the blocks loaded */
#endif
    return bad;
}

/* Blocks start..stop at dst[i], nbytes each: the first i whose xxh3 differs from sums[i], else -1. */
static int64_t first_mismatch(const uint64_t *dst, const uint64_t *sums, int64_t start, int64_t stop, size_t nbytes) {
    for (int64_t i = start; i < stop; i++)
        if (XXH3_64bits((const void *)(uintptr_t)dst[i], nbytes) != sums[i]) return i;
    return -1;
}

static PyObject *py_first_mismatch(PyObject *self, PyObject *args) {
    unsigned long long dst, sums;
    long long start, stop, nbytes;
    if (!PyArg_ParseTuple(args, "KKLLL", &dst, &sums, &start, &stop, &nbytes))
        return NULL;
    if (start < 0 || stop < start || nbytes <= 0 || !dst || !sums) {
        PyErr_Format(PyExc_ValueError, "first_mismatch: start=%lld stop=%lld nbytes=%lld", start, stop, nbytes);
        return NULL;
    }
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = first_mismatch((const uint64_t *)(uintptr_t)dst, (const uint64_t *)(uintptr_t)sums, start, stop,
                         (size_t)nbytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

static PyObject *py_hash_rows(PyObject *self, PyObject *args) {
    unsigned long long base, out;
    long long stride, n, nbytes;
    if (!PyArg_ParseTuple(args, "KLKLL", &base, &stride, &out, &n, &nbytes))
        return NULL;
    if (n < 0 || nbytes <= 0 || stride < nbytes || !base || !out) {
        PyErr_Format(PyExc_ValueError, "hash_rows: stride=%lld n=%lld nbytes=%lld", stride, n, nbytes);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < n; i++)
        ((uint64_t *)(uintptr_t)out)[i] = XXH3_64bits((const char *)(uintptr_t)base + i * stride, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_copy_verify(PyObject *self, PyObject *args) {
    unsigned long long src, offs, dst, sums;
    long long start, stop, slot;
    if (!PyArg_ParseTuple(args, "KKKKLLL", &src, &offs, &dst, &sums, &start, &stop, &slot))
        return NULL;
    if (start < 0 || stop < start || slot <= 0) {
        PyErr_Format(PyExc_ValueError, "copy_verify: start=%lld stop=%lld slot=%lld", start, stop, slot);
        return NULL;
    }
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = copy_verify((const char *)(uintptr_t)src, (const int64_t *)(uintptr_t)offs,
                      (const uint64_t *)(uintptr_t)dst, sums ? (const uint64_t *)(uintptr_t)sums : NULL,
                      start, stop, (size_t)slot);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

static PyMethodDef methods[] = {
    {"copy_verify", py_copy_verify, METH_VARARGS,
     "copy_verify(src, offsets, dests, sums, start, stop, slot) -> int\n\n"
     "Raw addresses: src (the arena's base), offsets (int64 per block), dests (uint64 per block), sums\n"
     "(uint64 per block, or 0 for no check). Copies blocks start..stop, slot bytes each, without the\n"
     "GIL; returns the first block whose xxh3 differs from its sum, else -1. The caller checks every\n"
     "offset and address first and keeps the memory alive until it returns."},
    {"hash_rows", py_hash_rows, METH_VARARGS,
     "hash_rows(base, stride, out, n, nbytes) -> None\n\n"
     "Raw addresses: rows at base + i * stride (nbytes each), out (uint64 per row). Writes each row's\n"
     "xxh3 into out[i] for i < n, without the GIL."},
    {"first_mismatch", py_first_mismatch, METH_VARARGS,
     "first_mismatch(blocks, sums, start, stop, nbytes) -> int\n\n"
     "Raw addresses: blocks (uint64 per block), sums (uint64 per block). Hashes blocks start..stop,\n"
     "nbytes each, without the GIL; returns the first whose xxh3 differs from its sum, else -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockcopy",
                                    "The shm pull's per-block copy and checksum check, without the GIL.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__blockcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAMING_STORES", HAVE_STREAM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
