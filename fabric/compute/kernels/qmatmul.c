/* y = x @ W^T with W kept as a GGUF file keeps it: blocks of 32 inputs, 5- or 8-bit codes.
 *
 * Each weight the kernel multiplies by is the file's own float32 weight: a block's step and
 * minimum come from the file's float16 (and Q5_K's 6-bit multipliers) in float32, as llama.cpp
 * and gguf-py compute them, and weight = minimum + code * step (code * step is exact: at most
 * 22 significant bits; the one rounding is the file's). Kinds:
 *   Q5_0: step d, minimum -16 d;  Q5_1: step d, minimum m;  Q8_0: step d, signed codes, no minimum;
 *   Q5_K: step d * sc, minimum -(dmin * m), d and dmin per 256 inputs, sc and m per block.
 * Storage per output row: 5-bit codes as llama.cpp's Q5_0 keeps them (16 bytes of nibbles, byte
 * j holding inputs j and j + 16, and a 32-bit word of fifth bits), or int8 codes.
 *
 * Batch-invariant: an output element's sum is one fixed order, whichever rows came with it and
 * however many threads ran. Its 32 lanes (a block's inputs 0..15 and 16..31) each add their
 * products block by block, in order; the lanes end in one fixed tree. Threads split the outputs,
 * never a sum. Rows are grouped to share each dequantized block (in registers for a few rows,
 * through a buffer of the outputs' float32 weights for many): how they are grouped changes the
 * speed, never a row's arithmetic. GCC's vector types carry the lanes, so the one source builds
 * for AVX-512, AVX2 or SSE; no -ffast-math (fabric/compute/native.py), so the order written here
 * is the order computed.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define BLOCK 32
#define SUPER 256   /* Q5_K's super-block */
#define OUTS 8      /* outputs that share each load of a row of x (and threads split by tiles of this many) */
#define FUSED_ROWS 2 /* up to this many rows, weights are dequantized in registers, per row group */
#define ROWS 2      /* rows that share each load of a dequantized weight */
#define BOUTS 4     /* outputs a buffered pass holds at once (BOUTS x ROWS x 2 accumulators) */

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16 __attribute__((vector_size(64)));

enum { Q5_0 = 0, Q5_1 = 1, Q5_K = 2, Q8_0 = 3 };
enum { F_BF16 = 0, F_F32 = 2 };

typedef struct {
    const uint8_t *codes;   /* 5-bit: (out, in / 2) nibbles; Q8_0: (out, in) int8 */
    const uint32_t *high;   /* 5-bit: (out, in / 32) fifth bits, bit i for input i of the block */
    const _Float16 *d;      /* (out, in / 32) steps; Q5_K: (out, in / 256, 2) d and dmin */
    const _Float16 *m;      /* Q5_1: (out, in / 32) minima */
    const uint8_t *sm;      /* Q5_K: (out, in / 32, 2) 6-bit sc and m */
    const void *x;          /* (rows, in), contiguous, xfmt */
    void *y;                /* (rows, out), contiguous, yfmt */
    int64_t rows, in, out;
    int kind, xfmt, yfmt;
} QJob;

typedef struct { v16 lo, hi; } W32;  /* a block's 32 weights (or products) */

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16 at16(const float *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline void put16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

/* 16 bytes widened to 16 int32 lanes (GCC's __builtin_convertvector does this byte by byte):
   widen_u8 for unsigned codes, widen_s8 for signed ones. */
#if defined(__AVX512F__)
#define WIDEN(name, type, cvt512, cvt256)                                        \
    static inline i16 name(const type *p) {                                      \
        return (i16)cvt512(_mm_loadu_si128((const __m128i *)p));                 \
    }
#elif defined(__AVX2__)
#define WIDEN(name, type, cvt512, cvt256)                                        \
    static inline i16 name(const type *p) {                                      \
        __m128i b = _mm_loadu_si128((const __m128i *)p);                         \
        __m256i lo = cvt256(b), hi = cvt256(_mm_srli_si128(b, 8));               \
        i16 r;                                                                   \
        memcpy(&r, &lo, 32);                                                     \
        memcpy((char *)&r + 32, &hi, 32);                                        \
        return r;                                                                \
    }
#else
#define WIDEN(name, type, cvt512, cvt256)                                        \
    static inline i16 name(const type *p) {                                      \
        i16 r;                                                                   \
        for (int l = 0; l < 16; l++) r[l] = p[l];                                \
        return r;                                                                \
    }
#endif
WIDEN(widen_u8, uint8_t, _mm512_cvtepu8_epi32, _mm256_cvtepu8_epi32)
WIDEN(widen_s8, int8_t, _mm512_cvtepi8_epi32, _mm256_cvtepi8_epi32)

static inline float sum32(W32 a) {  /* one fixed tree */
    v16 x = a.lo + a.hi;
    float p[8], q[4];
    for (int l = 0; l < 8; l++) p[l] = x[l] + x[l + 8];
    for (int l = 0; l < 4; l++) q[l] = p[l] + p[l + 4];
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* Block b of output o, as float32 weights (the file's own). */
static inline __attribute__((always_inline)) W32 weights(const QJob *j, int kind, int64_t o, int64_t b) {
    int64_t nb = j->in / BLOCK, at = o * nb + b;
    float step, min = 0.0f;
    if (kind == Q5_K) {
        const _Float16 *dd = j->d + (o * (j->in / SUPER) + b / 8) * 2;
        step = (float)dd[0] * (float)j->sm[at * 2];
        min = -((float)dd[1] * (float)j->sm[at * 2 + 1]);
    } else {
        step = (float)j->d[at];
        if (kind == Q5_0) min = -16.0f * step;
        if (kind == Q5_1) min = (float)j->m[at];
    }
    W32 w;
    if (kind == Q8_0) {
        const int8_t *c = (const int8_t *)j->codes + at * BLOCK;
        w.lo = __builtin_convertvector(widen_s8(c), v16) * step;
        w.hi = __builtin_convertvector(widen_s8(c + 16), v16) * step;
        return w;
    }
    u16 n = (u16)widen_u8(j->codes + at * (BLOCK / 2));
    uint32_t h = j->high[at];
    u16 lo = n & 15, hi = n >> 4;
#if defined(__AVX512F__)
    lo = (u16)_mm512_mask_or_epi32((__m512i)lo, (__mmask16)h, (__m512i)lo, _mm512_set1_epi32(16));
    hi = (u16)_mm512_mask_or_epi32((__m512i)hi, (__mmask16)(h >> 16), (__m512i)hi, _mm512_set1_epi32(16));
#else
    static const u16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    u16 hv = (u16){0} + h;
    lo |= ((hv >> lane) & 1) << 4;
    hi |= ((hv >> (lane + 16)) & 1) << 4;
#endif
    w.lo = __builtin_convertvector(lo, v16) * step + min;  /* code * step exact: one rounding */
    w.hi = __builtin_convertvector(hi, v16) * step + min;
    return w;
}

static void store(const QJob *j, int64_t r, int64_t o, float v) {
    if (j->yfmt == F_F32) {
        ((float *)j->y)[r * j->out + o] = v;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) bits |= 0x00400000u; /* NaN stays NaN */
    else bits += 0x7fffu + ((bits >> 16) & 1u);                   /* round to nearest even */
    ((uint16_t *)j->y)[r * j->out + o] = (uint16_t)(bits >> 16);
}

/* Outputs o..o + nout of rows r..r + nrows, weights dequantized here block by block. */
static inline __attribute__((always_inline)) void fused(const QJob *j, const float *x, int kind, int64_t o,
                                                        int nout, int64_t r, int nrows) {
    W32 acc[OUTS][FUSED_ROWS];
    for (int k = 0; k < nout; k++)
        for (int i = 0; i < nrows; i++) acc[k][i].lo = acc[k][i].hi = splat(0.0f);
    for (int64_t b = 0; b < j->in / BLOCK; b++) {
        for (int k = 0; k < nout; k++) {
            W32 w = weights(j, kind, o + k, b);
            for (int i = 0; i < nrows; i++) {
                const float *xr = x + (r + i) * j->in + b * BLOCK;
                acc[k][i].lo += w.lo * at16(xr);
                acc[k][i].hi += w.hi * at16(xr + 16);
            }
        }
    }
    for (int k = 0; k < nout; k++)
        for (int i = 0; i < nrows; i++) store(j, r + i, o + k, sum32(acc[k][i]));
}

/* As fused, the weights read from wb: (nout, in) float32, dequantized once for every row. */
static inline __attribute__((always_inline)) void buffered(const QJob *j, const float *x, const float *wb,
                                                           int64_t o, int nout, int64_t r, int nrows) {
    W32 acc[BOUTS][ROWS];
    for (int k = 0; k < nout; k++)
        for (int i = 0; i < nrows; i++) acc[k][i].lo = acc[k][i].hi = splat(0.0f);
    for (int64_t at = 0; at < j->in; at += BLOCK) {
        for (int k = 0; k < nout; k++) {
            v16 lo = at16(wb + k * j->in + at), hi = at16(wb + k * j->in + at + 16);
            for (int i = 0; i < nrows; i++) {
                const float *xr = x + (r + i) * j->in + at;
                acc[k][i].lo += lo * at16(xr);
                acc[k][i].hi += hi * at16(xr + 16);
            }
        }
    }
    for (int k = 0; k < nout; k++)
        for (int i = 0; i < nrows; i++) store(j, r + i, o + k, sum32(acc[k][i]));
}

static void fused_tile(const QJob *j, const float *x, int kind, int64_t o, int nout) {
    int64_t r = 0;
    for (; r + 2 <= j->rows; r += 2) {
        if (nout == OUTS) fused(j, x, kind, o, OUTS, r, 2);
        else for (int k = 0; k < nout; k++) fused(j, x, kind, o + k, 1, r, 2);
    }
    for (; r < j->rows; r++) {
        if (nout == OUTS) fused(j, x, kind, o, OUTS, r, 1);
        else for (int k = 0; k < nout; k++) fused(j, x, kind, o + k, 1, r, 1);
    }
}

static void buffered_tile(const QJob *j, const float *x, float *wb, int kind, int64_t o, int nout) {
    for (int k = 0; k < nout; k++)
        for (int64_t b = 0; b < j->in / BLOCK; b++) {
            W32 w = weights(j, kind, o + k, b);
            put16(wb + k * j->in + b * BLOCK, w.lo);
            put16(wb + k * j->in + b * BLOCK + 16, w.hi);
        }
    for (int k = 0; k < nout; k += BOUTS) {
        const float *w = wb + k * j->in;
        int n = nout - k < BOUTS ? nout - k : BOUTS;
        int64_t r = 0;
        for (; r + ROWS <= j->rows; r += ROWS) {
            if (n == BOUTS) buffered(j, x, w, o + k, BOUTS, r, ROWS);
            else for (int i = 0; i < n; i++) buffered(j, x, w + i * j->in, o + k + i, 1, r, ROWS);
        }
        for (; r < j->rows; r++) {
            if (n == BOUTS) buffered(j, x, w, o + k, BOUTS, r, 1);
            else for (int i = 0; i < n; i++) buffered(j, x, w + i * j->in, o + k + i, 1, r, 1);
        }
    }
}

/* One tile of outputs, the kind a constant in each copy (the compiler drops the others' code). */
static void tile(const QJob *j, const float *x, float *wb, int64_t o, int nout) {
    int many = j->rows > FUSED_ROWS;
    switch (j->kind) {
    case Q5_0: many ? buffered_tile(j, x, wb, Q5_0, o, nout) : fused_tile(j, x, Q5_0, o, nout); break;
    case Q5_1: many ? buffered_tile(j, x, wb, Q5_1, o, nout) : fused_tile(j, x, Q5_1, o, nout); break;
    case Q5_K: many ? buffered_tile(j, x, wb, Q5_K, o, nout) : fused_tile(j, x, Q5_K, o, nout); break;
    default: many ? buffered_tile(j, x, wb, Q8_0, o, nout) : fused_tile(j, x, Q8_0, o, nout); break;
    }
}

/* x as float32 (bfloat16 widens exactly); x itself where it is float32 already. */
static const float *widened(const QJob *j, float **owned) {
    *owned = NULL;
    if (j->xfmt == F_F32) return (const float *)j->x;
    int64_t n = j->rows * j->in;
    float *xf = malloc(sizeof(float) * (size_t)n);
    if (!xf) return NULL;
    const uint16_t *src = (const uint16_t *)j->x;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(xf + i, &bits, 4);
    }
    *owned = xf;
    return xf;
}

/* Runs `job` on `threads` threads. Returns 0, or -1 where working memory could not be had. */
int meshnet_qmatmul(const QJob *job, int threads) {
    if (job->in % BLOCK || (job->kind == Q5_K && job->in % SUPER)) return -2;
    float *owned;
    const float *x = widened(job, &owned);
    if (!x) return -1;
    int64_t tiles = (job->out + OUTS - 1) / OUTS;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|| : failed)
    {
        float *wb = job->rows > FUSED_ROWS ? malloc(sizeof(float) * OUTS * (size_t)job->in) : NULL;
        failed = job->rows > FUSED_ROWS && !wb;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (failed) continue;
            int64_t o = t * OUTS;
            tile(job, x, wb, o, job->out - o < OUTS ? (int)(job->out - o) : OUTS);
        }
        free(wb);
    }
    free(owned);
    return failed ? -1 : 0;
}

/* The float32 weights of outputs o..o + n (n, in), for checks: what the kernel multiplies by. */
void meshnet_qweights(const QJob *job, int64_t o, int64_t n, float *out) {
    for (int64_t k = 0; k < n; k++)
        for (int64_t b = 0; b < job->in / BLOCK; b++) {
            W32 w;
            switch (job->kind) {
            case Q5_0: w = weights(job, Q5_0, o + k, b); break;
            case Q5_1: w = weights(job, Q5_1, o + k, b); break;
            case Q5_K: w = weights(job, Q5_K, o + k, b); break;
            default: w = weights(job, Q8_0, o + k, b); break;
            }
            put16(out + k * job->in + b * BLOCK, w.lo);
            put16(out + k * job->in + b * BLOCK + 16, w.hi);
        }
}
