/* y = x @ W^T for decode-sized x, llama.cpp's arithmetic: x quantized to int8, integer dot products.
 *
 * Each row of x is quantized per block of 32 inputs, in one fixed order: d = absmax / 127,
 * q = round-to-nearest-even(x / d) in -127..127 (x times 1 / d, as llama.cpp's q8_0), with the
 * block's sum of codes s kept for the minimum term. Weights are unsigned codes u with a step
 * and a minimum per block of 32 (w = minimum + u * step), so one integer dot product sum(u q)
 * per block serves every kind:
 *   K4_F16, K4_F32: 4-bit codes (Q4_0: minimum -8 step; Q4_1: the file's m; Q4_K: d sc and
 *                   -dmin m), the step and minimum per block as float16 (where exact) or float32;
 *   K4_K:           Q4_K as the file holds it: the block's 6-bit multipliers sc and m (float16, exact)
 *                   and the super-block's float16 d and -dmin, so step = d sc and minimum = (-dmin) m,
 *                   each exact in float32 (the values K4_F32 would hold, in 0.85x its bytes);
 *   K8_F16:         Q8_0, int8 codes stored as u = c + 128, the file's float16 step per block;
 *   K8_ROW:         int8 codes per output row (u = c + 128) and a float32 scale per row.
 * For int8 the minimum term is -128 s (an integer), so every kind's block sum is exact in int32.
 *
 * Per output and block (b): int4: accs += (float)sum(u q) * (step * d_b), accm += minimum * (d_b s_b);
 * int8: acc += (float)(sum(u q) - 128 s_b) * (step * d_b) (K8_ROW: * d_b, times the row's scale at
 * the end). Blocks in order, one output per lane: the order is fixed whatever the batch size,
 * the row group or the thread count, so a row computed alone gives the bits it gives in any
 * batch. Threads split tiles of 16 outputs, never a sum. The three instruction paths (AVX-512
 * VNNI, AVX2 with maddubs, plain C; chosen when compiled) compute the same integers and then the
 * same float32 operations, multiply-adds written as fused ones, so they give the same bits.
 *
 * Layout: tiles of 16 outputs (the last padded with zero weights); a tile holds its blocks in
 * order. A block's codes are 8 groups of 4 inputs, each group a 64-byte register: output k's 4
 * codes at bytes 4k..4k+3 (what a dot product of 4 bytes per 32-bit lane wants). int4: register
 * j (0..3) holds group j in its low nibbles and group j + 4 in its high ones (256 bytes); int8:
 * 8 registers (512 bytes). Then the block's 16 steps (and 16 minima) for int4 and K8_F16;
 * K8_ROW keeps its 16 row scales after the tile's last block; K4_K its blocks' 16 sc then 16 m where
 * K4_F16 keeps steps and minima, and each super-block's 16 d then 16 -dmin (float16, 64 bytes) before
 * its 8 blocks: a sweep reads them in order (at the tile's end they were a second stream, read from
 * memory once a super-block, and a one-row product of 8192 x 2048 took 1.6-1.9x the time).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define BLOCK 32
#define TILE 16
#define RG 4 /* rows that share each unpacked block of weights */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PATH_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PATH_AVX2 1
#endif

enum { K4_F16 = 0, K4_F32 = 1, K8_ROW = 2, K8_F16 = 3, K4_K = 4 };
enum { S_F32 = 0, S_F16 = 1, S_K = 2 }; /* how an int4 kind holds its steps and minima */
#define SUPER 8        /* K4_K: blocks of a super-block */
#define SUPER_BYTES 64 /* K4_K: a super-block's 16 d and 16 -dmin, float16 */
enum { F_BF16 = 0, F_F32 = 2 };

typedef struct {
    const uint8_t *w; /* (tiles, tile_bytes) */
    const void *x;    /* (rows, in), contiguous, xfmt */
    void *y;          /* (rows, out), contiguous, yfmt */
    int64_t rows, in, out;
    int kind, xfmt, yfmt;
} DJob;

typedef struct {   /* x quantized: per row, per block */
    int8_t *q;     /* (rows, in) */
    float *d;      /* (rows, in / 32) steps */
    float *c;      /* (rows, in / 32) d * s, the minimum term's factor */
    int32_t *s;    /* (rows, in / 32) sums of codes */
} Acts;

static inline int64_t block_bytes(int kind) {
    switch (kind) {
    case K4_F16: return 256 + 64;
    case K4_F32: return 256 + 128;
    case K4_K: return 256 + 64;
    case K8_F16: return 512 + 32;
    default: return 512;
    }
}

int64_t meshnet_q8dot_tile_bytes(int kind, int64_t in) {
    return (in / BLOCK) * block_bytes(kind) + (kind == K8_ROW ? TILE * 4 : 0)
           + (kind == K4_K ? in / (BLOCK * SUPER) * SUPER_BYTES : 0);
}

static inline int k4_kind(int scales) { return scales == S_K ? K4_K : scales == S_F16 ? K4_F16 : K4_F32; }

/* Where K4_K's super-block of block b keeps its 16 d (and 32 bytes on, 16 -dmin). */
static inline const uint8_t *k4_super(const uint8_t *tw, int64_t b) {
    return tw + (b / SUPER) * (SUPER_BYTES + SUPER * block_bytes(K4_K));
}

/* Block b of an int4 tile: K4_K's blocks follow their super-block's factors. */
static inline const uint8_t *k4_block(const uint8_t *tw, int64_t b, int64_t bb, int scales) {
    return scales == S_K ? k4_super(tw, b) + SUPER_BYTES + (b % SUPER) * bb : tw + b * bb;
}

static inline float widen16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static inline uint16_t narrow16(float v) { /* round to nearest even, as torch's bfloat16; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits | 0x00400000u) >> 16);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* out = bf16(a + b) over n bfloat16s (out may be a or b): torch's residual add. */
static void add_rows(uint16_t *out, const uint16_t *a, const uint16_t *b, int64_t n) {
    for (int64_t k = 0; k < n; k++) out[k] = narrow16(widen16(a[k]) + widen16(b[k]));
}

static inline float load_x(const DJob *j, int64_t at) {
    return j->xfmt == F_F32 ? ((const float *)j->x)[at] : widen16(((const uint16_t *)j->x)[at]);
}

/* One row's block: codes, step, and its sum; the same IEEE operations on every path. */
#if defined(__AVX2__)
/* 8 lanes of x from `at`, as float32. */
static inline __m256 load8_x(const DJob *j, int64_t at) {
    if (j->xfmt == F_F32) return _mm256_loadu_ps((const float *)j->x + at);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)j->x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The plain loop's operations 8 lanes at a time: the largest magnitude (a maximum is exact in any
 * order, and a NaN is passed over as fmaxf does: max_ps returns its second operand), x * (1 / d)
 * rounded to nearest even, truncated to int32 and clamped as the plain cast and clamp do. It was
 * 5-6% of a node's time at 8 streams as a scalar loop calling libm's fmaxf. */
static void quantize_block(const DJob *j, int64_t at, int8_t *q, float *d, float *c, int32_t *s) {
    __m256 v[4], mag = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = load8_x(j, at + 8 * i);
        mag = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]), mag);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mag), _mm256_extractf128_ps(mag, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    float step = amax / 127.0f, inv = step != 0.0f ? 1.0f / step : 0.0f;
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    __m256i codes[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256 x = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        codes[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvttps_epi32(x), top), bottom);
        sum = _mm256_add_epi32(sum, codes[i]);
    }
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, packed);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *d = step;
    *s = _mm_cvtsi128_si32(t);
    *c = step * (float)*s;
}
#else
static void quantize_block(const DJob *j, int64_t at, int8_t *q, float *d, float *c, int32_t *s) {
    float v[BLOCK], amax = 0.0f;
    for (int i = 0; i < BLOCK; i++) {
        v[i] = load_x(j, at + i);
        amax = fmaxf(amax, fabsf(v[i]));
    }
    float step = amax / 127.0f, inv = step != 0.0f ? 1.0f / step : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < BLOCK; i++) {
        int32_t code = (int32_t)nearbyintf(v[i] * inv);
        code = code > 127 ? 127 : code < -127 ? -127 : code;
        q[i] = (int8_t)code;
        sum += code;
    }
    *d = step;
    *s = sum;
    *c = step * (float)sum;
}
#endif

static void quantize(const DJob *j, Acts *a) {
    int64_t nb = j->in / BLOCK;
    for (int64_t r = 0; r < j->rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            int64_t k = r * nb + b;
            quantize_block(j, r * j->in + b * BLOCK, a->q + r * j->in + b * BLOCK, a->d + k, a->c + k, a->s + k);
        }
}

static inline float f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

static void store(const DJob *j, int64_t r, int64_t o, float v) {
    if (j->yfmt == F_F32) {
        ((float *)j->y)[r * j->out + o] = v;
        return;
    }
    ((uint16_t *)j->y)[r * j->out + o] = narrow16(v);
}

static inline int32_t word(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- AVX-512 VNNI: 16 outputs a register, one 4-byte dot product a lane ---- */
#if defined(PATH_VNNI)
static inline __attribute__((always_inline)) __m512i dot_block(const __m512i w[8], const int8_t *xq) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int g = 0; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(word(xq + 4 * g)));
        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(word(xq + 4 * g + 4)));
    }
    return _mm512_add_epi32(s0, s1);
}

static inline __attribute__((always_inline)) void k4_rows(const DJob *j, const Acts *a, const uint8_t *tw,
                                                          int64_t r0, const int R, float out[RG][TILE], const int scales) {
    int64_t nb = j->in / BLOCK, bb = block_bytes(k4_kind(scales));
    __m512 accs[RG], accm[RG], d = _mm512_setzero_ps(), ndmin = _mm512_setzero_ps();  /* K4_K's super-block */
    for (int r = 0; r < R; r++) accs[r] = accm[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = k4_block(tw, b, bb, scales);
        __m512i w[8];
        for (int g = 0; g < 4; g++) {
            __m512i v = _mm512_loadu_si512(blk + 64 * g);
            w[g] = _mm512_and_si512(v, low);
            w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        __m512 step, min;
        if (scales == S_F32) {
            step = _mm512_loadu_ps(blk + 256);
            min = _mm512_loadu_ps(blk + 320);
        } else {
            step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
            min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
        }
        if (scales == S_K) {  /* sc and m times d and -dmin: exact products */
            if (b % SUPER == 0) {
                const uint8_t *sup = k4_super(tw, b);
                d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sup));
                ndmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sup + 32)));
            }
            step = _mm512_mul_ps(step, d);
            min = _mm512_mul_ps(min, ndmin);
        }
        for (int r = 0; r < R; r++) {
            int64_t k = (r0 + r) * nb + b;
            __m512i s = dot_block(w, a->q + (r0 + r) * j->in + b * BLOCK);
            accs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(step, _mm512_set1_ps(a->d[k])), accs[r]);
            accm[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(a->c[k]), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], _mm512_add_ps(accs[r], accm[r]));
}

static inline __attribute__((always_inline)) void k8_rows(const DJob *j, const Acts *a, const uint8_t *tw,
                                                          int64_t r0, const int R, float out[RG][TILE], const int per_block) {
    int64_t nb = j->in / BLOCK, bb = block_bytes(per_block ? K8_F16 : K8_ROW);
    __m512 acc[RG];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tw + b * bb;
        __m512i w[8];
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(blk + 64 * g);
        __m512 step = per_block ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512))) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            int64_t k = (r0 + r) * nb + b;
            __m512i s = dot_block(w, a->q + (r0 + r) * j->in + b * BLOCK);
            __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(s, _mm512_set1_epi32(128 * a->s[k])));
            acc[r] = per_block ? _mm512_fmadd_ps(f, _mm512_mul_ps(step, _mm512_set1_ps(a->d[k])), acc[r])
                               : _mm512_fmadd_ps(f, _mm512_set1_ps(a->d[k]), acc[r]);
        }
    }
    __m512 scale = per_block ? _mm512_setzero_ps() : _mm512_loadu_ps(tw + nb * bb);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], per_block ? acc[r] : _mm512_mul_ps(acc[r], scale));
}

/* ---- AVX2: each tile in two halves of 8 outputs; maddubs, int8 by the sign trick ----
 * Two loop orders, the same integers. One row holds a block's unpacked codes in registers and runs
 * them against its activations (held). Several rows take the codes a register at a time, each row
 * adding its products to its own integer sum (grouped): holding 8 or 16 registers of codes beside 4
 * rows' accumulators spills on AVX2's 16 registers, and did cost a 4-row call of the lm_head 25%
 * on an AVX2-only CPU (`bench/q8dot.py`, docs/BENCHMARKS.md). */
#elif defined(PATH_AVX2)
#define GROUPED_FROM 2 /* rows from which the grouped order pays */
#define AHEAD 2048 /* bytes of weights asked for ahead of a tile's first half */

/* v's sum so far, kept in a register: without it the compiler defers each row's additions to the
 * block's end, holding every product of the block (4 rows of 8 registers) on the stack. A 4-row
 * product took 1.2-1.45x the time without it for SmolLM2's int4 projections, 1.05-1.1x for its int8
 * lm_head, on an AVX2-only CPU (docs/BENCHMARKS.md, *Four rows' sums in registers*). */
static inline __attribute__((always_inline)) void in_register(__m256i *v) { __asm__("" : "+x"(*v)); }

/* The cache lines of `bytes` from `p` asked for now. Several rows read a tile's weights in two
 * halves of outputs: the first from memory, the second from the cache. Asking for what comes next
 * during both (the first half: AHEAD bytes on; the second: the same block of the next tile) keeps
 * memory busy while the second computes: a decode step's products stream every weight from
 * memory once, and SmolLM2's 120 products a token took 0.8x the time with this on Zen 1
 * (docs/BENCHMARKS.md, *Weights asked for ahead*). One row reads each block once, both halves
 * together, asking for AHEAD bytes on: its products took 0.6-0.9x the time of two sweeps over
 * the tile (*One sweep for one row*). Past the last tile it asks for lines no one reads, which
 * costs nothing more: a prefetch never faults. */
static inline void ask_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at);
}

/* Each row's sum(u q) over one block's 8 outputs of half h, as 16 int16 pairs (int4: 8 pairs of
 * at most 2 * 15 * 127 each, no overflow). */
static inline __attribute__((always_inline)) void k4_sums(const uint8_t *blk, const int8_t *xq, int64_t in,
                                                          const int R, const int h, __m256i p[RG]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int r = 0; r < R; r++) p[r] = _mm256_setzero_si256();
    if (R < GROUPED_FROM) {  /* held */
        __m256i w[8];
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32 * h));
            w[g] = _mm256_and_si256(v, low);
            w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; r++)
            for (int g = 0; g < 8; g++)
                p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(word(xq + r * in + 4 * g))));
        return;
    }
    for (int g = 0; g < 4; g++) {  /* grouped */
        __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32 * h));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * in + 4 * g;
            p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(word(x))));
            p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(word(x + 16))));
            in_register(&p[r]);
        }
    }
}

/* Each row's sum(c q) over one block's 8 outputs of half h, in int32: maddubs of |c| and q signed
 * as c (pairs of at most 2 * 128 * 127), widened at once. */
static inline __attribute__((always_inline)) void k8_sums(const uint8_t *blk, const int8_t *xq, int64_t in,
                                                          const int R, const int h, __m256i s[RG]) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
    if (R < GROUPED_FROM) {  /* held */
        __m256i w[8], mag[8];
        for (int g = 0; g < 8; g++) {  /* the signed code u - 128, and its magnitude */
            w[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32 * h)), flip);
            mag[g] = _mm256_abs_epi8(w[g]);
        }
        for (int r = 0; r < R; r++)
            for (int g = 0; g < 8; g++) {
                __m256i p = _mm256_maddubs_epi16(mag[g], _mm256_sign_epi8(_mm256_set1_epi32(word(xq + r * in + 4 * g)), w[g]));
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
            }
        return;
    }
    for (int g = 0; g < 8; g++) {  /* grouped */
        __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32 * h)), flip);
        __m256i mag = _mm256_abs_epi8(w);
        for (int r = 0; r < R; r++) {
            __m256i p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(_mm256_set1_epi32(word(xq + r * in + 4 * g)), w));
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
            in_register(&s[r]);
        }
    }
}

/* Half h's 8 steps and minima of int4 block b (at blk) of tile tw. */
static inline __attribute__((always_inline)) void k4_scales(const uint8_t *tw, int64_t b, const uint8_t *blk,
                                                            const int scales, const int h, __m256 *step, __m256 *min) {
    if (scales == S_F32) {
        *step = _mm256_loadu_ps((const float *)(blk + 256) + 8 * h);
        *min = _mm256_loadu_ps((const float *)(blk + 320) + 8 * h);
        return;
    }
    *step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 256 + 16 * h)));
    *min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 288 + 16 * h)));
    if (scales == S_K) {  /* sc and m times d and -dmin: exact products */
        const uint8_t *sup = k4_super(tw, b);
        *step = _mm256_mul_ps(*step, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + 16 * h))));
        *min = _mm256_mul_ps(*min, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + 32 + 16 * h))));
    }
}

/* Half h's minimum terms, added to the products in out: accm = sum over blocks of min * c, in block
 * order, as a sweep of its own over the tile (in the cache by now), so that the products' sweep
 * holds 4 rows' sums and accumulators in AVX2's 16 registers without spilling. */
static inline __attribute__((always_inline)) void k4_minima(const DJob *j, const Acts *a, const uint8_t *tw,
                                                            int64_t r0, const int R, const int h, float out[RG][TILE],
                                                            const int scales) {
    int64_t nb = j->in / BLOCK, bb = block_bytes(k4_kind(scales));
    __m256 accm[RG];
    for (int r = 0; r < R; r++) accm[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 step, min;
        k4_scales(tw, b, k4_block(tw, b, bb, scales), scales, h, &step, &min);
        for (int r = 0; r < R; r++) accm[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(a->c[(r0 + r) * nb + b]), accm[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * h, _mm256_add_ps(_mm256_loadu_ps(out[r] + 8 * h), accm[r]));
}

static inline __attribute__((always_inline)) void k4_rows(const DJob *j, const Acts *a, const uint8_t *tw,
                                                          int64_t r0, const int R, float out[RG][TILE], const int scales) {
    int64_t nb = j->in / BLOCK, bb = block_bytes(k4_kind(scales));
    int64_t next = meshnet_q8dot_tile_bytes(k4_kind(scales), j->in);
    const __m256i ones = _mm256_set1_epi16(1);
    if (R == 1) {  /* one sweep: each block's two halves together, the same operations per output */
        __m256 accs[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = k4_block(tw, b, bb, scales);
            ask_ahead(blk + AHEAD, bb);
            __m256 d = _mm256_set1_ps(a->d[r0 * nb + b]), c = _mm256_set1_ps(a->c[r0 * nb + b]);
            for (int h = 0; h < 2; h++) {
                __m256i p[RG];
                k4_sums(blk, a->q + r0 * j->in + b * BLOCK, j->in, 1, h, p);
                __m256 step, min;
                k4_scales(tw, b, blk, scales, h, &step, &min);
                accs[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p[0], ones)), _mm256_mul_ps(step, d), accs[h]);
                accm[h] = _mm256_fmadd_ps(min, c, accm[h]);
            }
        }
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[0] + 8 * h, _mm256_add_ps(accs[h], accm[h]));
        return;
    }
    for (int h = 0; h < 2; h++) {
        __m256 accs[RG];
        for (int r = 0; r < R; r++) accs[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = k4_block(tw, b, bb, scales);
            ask_ahead(blk + (h ? next : AHEAD), bb);
            __m256i p[RG];
            k4_sums(blk, a->q + r0 * j->in + b * BLOCK, j->in, R, h, p);
            __m256 step, min;
            k4_scales(tw, b, blk, scales, h, &step, &min);
            for (int r = 0; r < R; r++) {
                __m256i s = _mm256_madd_epi16(p[r], ones);
                accs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(step, _mm256_set1_ps(a->d[(r0 + r) * nb + b])), accs[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * h, accs[r]);
        k4_minima(j, a, tw, r0, R, h, out, scales);
    }
}

/* Half h's 8 steps of a K8_F16 block; the 8 row scales of a K8_ROW tile (after its blocks, at `at`). */
static inline __attribute__((always_inline)) __m256 k8_step(const uint8_t *blk, const int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 512 + 16 * h)));
}

static inline __attribute__((always_inline)) __m256 k8_row_scale(const uint8_t *tw, int64_t at, const int h) {
    return _mm256_loadu_ps((const float *)(tw + at) + 8 * h);
}

static inline __attribute__((always_inline)) void k8_rows(const DJob *j, const Acts *a, const uint8_t *tw,
                                                          int64_t r0, const int R, float out[RG][TILE], const int per_block) {
    int64_t nb = j->in / BLOCK, bb = block_bytes(per_block ? K8_F16 : K8_ROW);
    int64_t next = meshnet_q8dot_tile_bytes(per_block ? K8_F16 : K8_ROW, j->in);
    if (R == 1) {  /* one sweep: each block's two halves together, the same operations per output */
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = tw + b * bb;
            ask_ahead(blk + AHEAD, bb);
            __m256 d = _mm256_set1_ps(a->d[r0 * nb + b]);
            for (int h = 0; h < 2; h++) {
                __m256i s[RG];
                k8_sums(blk, a->q + r0 * j->in + b * BLOCK, j->in, 1, h, s);
                __m256 f = _mm256_cvtepi32_ps(s[0]);
                acc[h] = per_block ? _mm256_fmadd_ps(f, _mm256_mul_ps(k8_step(blk, h), d), acc[h]) : _mm256_fmadd_ps(f, d, acc[h]);
            }
        }
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(out[0] + 8 * h, per_block ? acc[h] : _mm256_mul_ps(acc[h], k8_row_scale(tw, nb * bb, h)));
        return;
    }
    for (int h = 0; h < 2; h++) {
        __m256 acc[RG];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = tw + b * bb;
            ask_ahead(blk + (h ? next : AHEAD), bb);
            __m256i s[RG];
            k8_sums(blk, a->q + r0 * j->in + b * BLOCK, j->in, R, h, s);
            __m256 step = per_block ? k8_step(blk, h) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                int64_t k = (r0 + r) * nb + b;
                __m256 f = _mm256_cvtepi32_ps(s[r]);
                acc[r] = per_block ? _mm256_fmadd_ps(f, _mm256_mul_ps(step, _mm256_set1_ps(a->d[k])), acc[r])
                                   : _mm256_fmadd_ps(f, _mm256_set1_ps(a->d[k]), acc[r]);
            }
        }
        __m256 scale = per_block ? _mm256_setzero_ps() : k8_row_scale(tw, nb * bb, h);
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * h, per_block ? acc[r] : _mm256_mul_ps(acc[r], scale));
    }
}

/* ---- plain C: the same integers, the same float32 operations, a lane at a time ---- */
#else
static inline float f32_at(const uint8_t *p) {
    float v;
    memcpy(&v, p, 4);
    return v;
}

static inline __attribute__((always_inline)) void k4_rows(const DJob *j, const Acts *a, const uint8_t *tw,
                                                          int64_t r0, const int R, float out[RG][TILE], const int scales) {
    int64_t nb = j->in / BLOCK, bb = block_bytes(k4_kind(scales));
    for (int r = 0; r < R; r++)
        for (int k = 0; k < TILE; k++) {
            float accs = 0.0f, accm = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = k4_block(tw, b, bb, scales);
                const int8_t *xq = a->q + (r0 + r) * j->in + b * BLOCK;
                int32_t s = 0;
                for (int g = 0; g < 8; g++)
                    for (int e = 0; e < 4; e++) {
                        uint8_t byte = blk[64 * (g % 4) + 4 * k + e];
                        s += (g < 4 ? byte & 15 : byte >> 4) * xq[4 * g + e];
                    }
                float step = scales == S_F32 ? f32_at(blk + 256 + 4 * k) : f16(blk + 256 + 2 * k);
                float min = scales == S_F32 ? f32_at(blk + 320 + 4 * k) : f16(blk + 288 + 2 * k);
                if (scales == S_K) {  /* sc and m times d and -dmin: exact products */
                    const uint8_t *sup = k4_super(tw, b);
                    step *= f16(sup + 2 * k);
                    min *= f16(sup + 32 + 2 * k);
                }
                int64_t at = (r0 + r) * nb + b;
                accs = fmaf((float)s, step * a->d[at], accs);
                accm = fmaf(min, a->c[at], accm);
            }
            out[r][k] = accs + accm;
        }
}

static inline __attribute__((always_inline)) void k8_rows(const DJob *j, const Acts *a, const uint8_t *tw,
                                                          int64_t r0, const int R, float out[RG][TILE], const int per_block) {
    int64_t nb = j->in / BLOCK, bb = block_bytes(per_block ? K8_F16 : K8_ROW);
    for (int r = 0; r < R; r++)
        for (int k = 0; k < TILE; k++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = tw + b * bb;
                const int8_t *xq = a->q + (r0 + r) * j->in + b * BLOCK;
                int32_t s = 0;
                for (int g = 0; g < 8; g++)
                    for (int e = 0; e < 4; e++) s += ((int32_t)blk[64 * g + 4 * k + e] - 128) * xq[4 * g + e];
                int64_t at = (r0 + r) * nb + b;
                acc = per_block ? fmaf((float)s, f16(blk + 512 + 2 * k) * a->d[at], acc) : fmaf((float)s, a->d[at], acc);
            }
            out[r][k] = per_block ? acc : acc * f32_at(tw + nb * bb + 4 * k);
        }
}
#endif

/* The row count a constant in each copy, so the accumulators stay in registers. */
#define BY_ROWS(fn, j, a, tw, r0, nrows, out, flag)              \
    switch (nrows) {                                             \
    case 1: fn(j, a, tw, r0, 1, out, flag); break;               \
    case 2: fn(j, a, tw, r0, 2, out, flag); break;               \
    case 3: fn(j, a, tw, r0, 3, out, flag); break;               \
    default: fn(j, a, tw, r0, 4, out, flag); break;              \
    }

/* Rows r0.. (at most RG) of one int4 tile, and of one int8 tile: two functions, so that the compiler
 * allocates each kind's registers on its own. */
static __attribute__((noinline)) void tile_k4(const DJob *j, const Acts *a, const uint8_t *tw, int64_t r0, int nrows,
                                              float out[RG][TILE]) {
    switch (j->kind) {
    case K4_F16: BY_ROWS(k4_rows, j, a, tw, r0, nrows, out, S_F16); break;
    case K4_F32: BY_ROWS(k4_rows, j, a, tw, r0, nrows, out, S_F32); break;
    default: BY_ROWS(k4_rows, j, a, tw, r0, nrows, out, S_K); break;
    }
}

static __attribute__((noinline)) void tile_k8(const DJob *j, const Acts *a, const uint8_t *tw, int64_t r0, int nrows,
                                              float out[RG][TILE]) {
    if (j->kind == K8_F16) {
        BY_ROWS(k8_rows, j, a, tw, r0, nrows, out, 1);
    } else {
        BY_ROWS(k8_rows, j, a, tw, r0, nrows, out, 0);
    }
}

/* Rows r0.. (at most RG) of one tile; the kind a constant in each copy. */
static void tile(const DJob *j, const Acts *a, int64_t t, int64_t r0, int nrows) {
    const uint8_t *tw = j->w + t * meshnet_q8dot_tile_bytes(j->kind, j->in);
    float out[RG][TILE];
    if (j->kind == K8_F16 || j->kind == K8_ROW)
        tile_k8(j, a, tw, r0, nrows, out);
    else
        tile_k4(j, a, tw, r0, nrows, out);
    int64_t o = t * TILE, n = j->out - o < TILE ? j->out - o : TILE;
    for (int r = 0; r < nrows; r++)
        for (int64_t k = 0; k < n; k++) store(j, r0 + r, o + k, out[r][k]);
}

static int acts_alloc(Acts *a, int64_t rows, int64_t in) {
    int64_t nb = in / BLOCK;
    a->q = malloc((size_t)(rows * in) + 64);
    a->d = malloc(sizeof(float) * (size_t)(rows * nb));
    a->c = malloc(sizeof(float) * (size_t)(rows * nb));
    a->s = malloc(sizeof(int32_t) * (size_t)(rows * nb));
    return a->q && a->d && a->c && a->s;
}

static void acts_free(Acts *a) {
    free(a->q);
    free(a->d);
    free(a->c);
    free(a->s);
}

/* x's rows quantized into `a`: 0; -1 where working memory could not be had, -2 for inputs not in
   whole blocks. */
static int quantized(const DJob *job, Acts *a) {
    if (job->in % BLOCK) return -2;
    if (!acts_alloc(a, job->rows, job->in)) {
        acts_free(a);
        return -1;
    }
    quantize(job, a);
    return 0;
}

/* Runs `job` on `threads` threads. Returns 0, or what `quantized` returns. */
int meshnet_q8dot(const DJob *job, int threads) {
    Acts a;
    int failed = quantized(job, &a);
    if (failed) return failed;
    int64_t tiles = (job->out + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r = 0; r < job->rows; r += RG)
            tile(job, &a, t, r, job->rows - r < RG ? (int)(job->rows - r) : RG);
    acts_free(&a);
    return 0;
}

/* A llama MLP and its residual in one call, bfloat16 throughout, rounding where torch's operators
 * round: g = gate_up(x) (rows, 2 I) bfloat16; a = bf16(silu(g[:, :I]) * g[:, I:]), silu read from
 * `silu`, torch's own bfloat16 silu of every bfloat16 (65,536 entries, built by torch); y =
 * bf16(down(a)); down->y = bf16(y + residual). gate_up->x is the normed rows, gate_up->y and
 * down->x are ignored (scratch here), down->y receives the output (it may be `residual`).
 * Returns 0, or what `meshnet_q8dot` returns. */
int meshnet_q8dot_mlp(const DJob *gate_up, const DJob *down, const uint16_t *silu, const uint16_t *residual,
                      int threads_gate_up, int threads_down) {
    const int64_t rows = gate_up->rows, inner = down->in, width = down->out;
    uint16_t *g = malloc(sizeof(uint16_t) * (size_t)(rows * 2 * inner));
    uint16_t *a = malloc(sizeof(uint16_t) * (size_t)(rows * inner));
    uint16_t *y = malloc(sizeof(uint16_t) * (size_t)(rows * width));
    int rc = -1;
    if (g && a && y && gate_up->out == 2 * inner) {
        DJob first = *gate_up, second = *down;
        first.y = g;
        first.yfmt = F_BF16;
        rc = meshnet_q8dot(&first, threads_gate_up);
        for (int64_t r = 0; rc == 0 && r < rows; r++)
            for (int64_t i = 0; i < inner; i++)
                a[r * inner + i] = narrow16(widen16(silu[g[r * 2 * inner + i]]) * widen16(g[r * 2 * inner + inner + i]));
        second.x = a, second.y = y, second.xfmt = second.yfmt = F_BF16;
        if (rc == 0) rc = meshnet_q8dot(&second, threads_down);
        if (rc == 0) add_rows((uint16_t *)down->y, y, residual, rows * width);
    }
    free(g);
    free(a);
    free(y);
    return rc;
}

/* y (rows, n) += bias (n), each sum rounded to bfloat16 as torch's bfloat16 add rounds it: qwen2's
 * q/k/v bias in kernels/decode.c's pass. */
void meshnet_q8dot_add_bias(uint16_t *y, const uint16_t *bias, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) add_rows(y + r * n, y + r * n, bias, n);
}

/* kernels/lean.c's meshnet_rms_norm, handed over by address (a library of its own). */
typedef int (*NormFn)(const uint16_t *x, int64_t rows, int64_t n, int64_t groups, int64_t x_stride, int64_t x_run,
                      const uint16_t *weight, float eps, int lanes, uint16_t *out);

typedef struct {
    NormFn fn;
    const uint16_t *weight;
    float eps;
    int lanes;
} NormArgs;

/* What follows a llama layer's attention, in one call: h = bf16(bf16(o(a)) + x), then
 * meshnet_q8dot_mlp over norm(h) with h as its residual. o->x is the attention's output a
 * (rows, heads * head_dim) bfloat16, o->y is ignored (scratch here); x (rows, hidden) is the
 * layer's input; the output goes to down->y. threads: o's, gate/up's, down's. */
int meshnet_q8dot_after_attention(const DJob *o, const uint16_t *x, const NormArgs *norm, const DJob *gate_up,
                                  const DJob *down, const uint16_t *silu, const int threads[3]) {
    const int64_t rows = o->rows, width = o->out;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(rows * width));
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)(rows * width));
    int rc = -1;
    if (h && normed && gate_up->in == width && down->out == width) {
        DJob first = *o, mlp = *gate_up;
        first.y = h;
        first.yfmt = F_BF16;
        rc = meshnet_q8dot(&first, threads[0]);
        if (rc == 0) add_rows(h, h, x, rows * width);
        if (rc == 0 && norm->fn(h, rows, width, 1, width, width, norm->weight, norm->eps, norm->lanes, normed))
            rc = -2;
        mlp.x = normed, mlp.rows = rows, mlp.xfmt = F_BF16;
        if (rc == 0) rc = meshnet_q8dot_mlp(&mlp, down, silu, h, threads[1], threads[2]);
    }
    free(h);
    free(normed);
    return rc;
}

/* x's quantization as the kernel makes it (for checks): q (rows, in), d and s (rows, in / 32). */
int meshnet_q8dot_quantize(const DJob *job, int8_t *q, float *d, int32_t *s) {
    Acts a;
    int failed = quantized(job, &a);
    if (failed) return failed;
    int64_t nb = job->in / BLOCK;
    memcpy(q, a.q, (size_t)(job->rows * job->in));
    memcpy(d, a.d, sizeof(float) * (size_t)(job->rows * nb));
    memcpy(s, a.s, sizeof(int32_t) * (size_t)(job->rows * nb));
    acts_free(&a);
    return 0;
}

/* The instruction path this build took: 2 AVX-512 VNNI, 1 AVX2, 0 plain C. */
int meshnet_q8dot_path(void) {
#if defined(PATH_VNNI)
    return 2;
#elif defined(PATH_AVX2)
    return 1;
#else
    return 0;
#endif
}
