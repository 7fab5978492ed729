/* Attention whose arithmetic for a query row depends only on that row, its keys and the head size.
 *
 * Every row is computed by the same loops in the same order, whichever chunk, batch or thread it
 * came in:
 *   - a score is the sum over the head, index by index in order, then scaled;
 *   - the softmax is in float32: its sum runs in LANES lanes over keys in blocks of LANES (16
 *     where the CPU has AVX-512, else 8) and ends in one fixed tree, where a masked key, or a key
 *     past the row's last, adds an exact 0;
 *   - the values are added key by key, in order.
 * So a position gives the same bits in a prefill chunk of any size, in a one-token step and in a
 * decode batch of any size, for any thread count (fabric/compute/attention.py says why that
 * matters; tests/test_invariant.py holds it).
 *
 * Rows are grouped to share each block of keys (transposed once, with shuffles) and each block of
 * values; how many share it changes the speed, never a row's arithmetic. GCC's vector types
 * carry the lanes, so the one source builds for AVX-512, AVX2 or SSE. Built once per machine by
 * fabric/compute/native.py, without -ffast-math, so the compiler keeps the order written here.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16 /* a vector's floats: one register */
#else
#define LANES 8 /* (AVX2: 16 lanes would live in pairs of registers, and spill) */
#endif
#define ROWS 8 /* rows whose scores are summed together at most, one accumulator each */
#define MAX_ROWS 64 /* rows of one work item: their scores stay in the cache */
#define BLOCKS 2 /* blocks of keys scored in one loop where a group has at most 4 rows: 2 x rows
                  * independent sums, where one block's rows alone wait on the adder's latency */
#define COLUMNS 2 /* blocks of a value's columns summed in one loop where a group has at most 4 rows */

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint16_t hv __attribute__((vector_size(2 * LANES)));  /* bfloat16 bits */

enum { F_BF16 = 0, F_F16 = 1, F_F32 = 2 };

typedef struct {
    const void *q, *k, *v;          /* query (b, heads, q, d); key, value (b, kv_heads, keys, d) */
    const uint8_t *keep;            /* (b or 1, q, keys), nonzero: attend; NULL: causal */
    void *out;                      /* (b, q, heads, d), contiguous */
    int64_t sq[3], sk[3], sv[3];    /* strides of b, head, position (the last dim is contiguous) */
    int64_t skeep[2];               /* strides of b (0 where shared) and query row in keep */
    int b, heads, kv_heads, nq, nk, d, fmt;
    float scale, softcap;           /* softcap 0: none */
} Job;

typedef struct {  /* one work item: rows first..first + n of key head kvh in batch row b */
    const Job *j;
    int b, kvh, first, n, dp, stop, width;
    int rg;                         /* rows that share each block of keys and values: 1-4 or ROWS */
    float *qf, *qt, *kt, *s, *acc, *total;  /* qt: qf by blocks of rg rows, each (d, rg); kt: BLOCKS x (dp, LANES) */
    int *ends;                      /* per row: one past its last key */
} Item;

static inline vf splat(float x) {
#if LANES == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return (vf){x, x, x, x, x, x, x, x};
#endif
}
static inline vf get(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void put(float *p, vf x) { memcpy(p, &x, sizeof x); }
static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }


/* n values of `base` from `at` as float32 (every format here widens exactly), zeros up to `to`. */
static void load(float *restrict dst, const void *base, int64_t at, int n, int to, int fmt) {
    if (fmt == F_BF16) {
        const uint16_t *src = (const uint16_t *)base + at;
        for (int i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(dst + i, &bits, 4);
        }
    } else if (fmt == F_F16) {
        const _Float16 *src = (const _Float16 *)base + at;
        for (int i = 0; i < n; i++) dst[i] = (float)src[i];
    } else {
        memcpy(dst, (const float *)base + at, sizeof(float) * n);
    }
    memset(dst + n, 0, sizeof(float) * (to - n));
}

typedef _Float16 hfv __attribute__((vector_size(2 * LANES)));

/* Elements at..at + LANES of `base` as float32 in a register (every format here widens exactly);
 * n < LANES: zeros past the first n. */
static inline vf take(const void *base, int64_t at, int n, int fmt) {
    if (n == LANES) {
        if (fmt == F_BF16) {
            hv h;
            memcpy(&h, (const uint16_t *)base + at, sizeof h);
            return (vf)(__builtin_convertvector(h, vi) << 16);
        }
        if (fmt == F_F16) {
            hfv h;
            memcpy(&h, (const _Float16 *)base + at, sizeof h);
            return __builtin_convertvector(h, vf);
        }
        return get((const float *)base + at);
    }
    float x[LANES];
    load(x, base, at, n, LANES, fmt);
    return get(x);
}

static void store(void *base, int64_t at, const float *src, int n, int fmt) {
    for (int i = 0; i < n; i++) {
        float x = src[i];
        if (fmt == F_BF16) {
            uint32_t bits;
            memcpy(&bits, &x, 4);
            if ((bits & 0x7fffffffu) > 0x7f800000u) bits |= 0x00400000u; /* NaN stays NaN */
            else bits += 0x7fffu + ((bits >> 16) & 1u);                   /* round to nearest even */
            ((uint16_t *)base)[at + i] = (uint16_t)(bits >> 16);
        } else if (fmt == F_F16) {
            ((_Float16 *)base)[at + i] = (_Float16)x;
        } else {
            ((float *)base)[at + i] = x;
        }
    }
}

/* exp(x) for x <= 0 (a score minus its row's maximum): 2^n * p(r), |r| <= ln2/2, within 2 ulp;
 * exactly 0 below the float range, as for a masked key's -inf. */
static inline vf expv(vf x) {
    vi under = x < splat(-87.0f);
    vf v = pick(under, splat(-87.0f), x);
    vf n = (v * 1.44269504f + 12582912.0f) - 12582912.0f;
    vf r = (v - n * 0.693145752f) - n * 1.42860677e-06f;
    vf p = splat(1.98756912e-4f);
    p = p * r + 1.39819994e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657962e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.0e-1f;
    p = p * r * r + r + 1.0f;
    vf scale = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
    return pick(under, splat(0.0f), p * scale);
}

static inline float sumv(vf x) {  /* one fixed tree */
#if LANES == 16
    float a[8], b[4];
    for (int l = 0; l < 8; l++) a[l] = x[l] + x[l + 8];
    for (int l = 0; l < 4; l++) b[l] = a[l] + a[l + 4];
#else
    float b[4];
    for (int l = 0; l < 4; l++) b[l] = x[l] + x[l + 4];
#endif
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Rows r[0..LANES - 1] become their transpose, in log2(LANES) stages of shuffles: at stage h,
 * rows i and i + h swap their blocks of h columns. One source for float rows and for rows of
 * bfloat16 bits, which move half the bytes, and within 128-bit lanes under AVX2. */
#if LANES == 16
enum { STAGES = 4 };
#define LOW_HALVES {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, \
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}, \
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, \
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}
#define HIGH_HALVES {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}, \
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}, \
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}, \
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}
#else
enum { STAGES = 3 };
#define LOW_HALVES {0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 8, 9, 4, 5, 12, 13}, {0, 8, 2, 10, 4, 12, 6, 14}
#define HIGH_HALVES {4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 10, 11, 6, 7, 14, 15}, {1, 9, 3, 11, 5, 13, 7, 15}
#endif
#define TRANSPOSE(name, T, MASK)                                                   \
    static void name(T *r) {                                                       \
        static const MASK lo[STAGES] = {LOW_HALVES}, hi[STAGES] = {HIGH_HALVES};   \
        _Pragma("GCC unroll 4") for (int stage = 0; stage < STAGES; stage++) {     \
            int h = (LANES / 2) >> stage;                                          \
            _Pragma("GCC unroll 8") for (int pair = 0; pair < LANES / 2; pair++) { \
                int i = pair / h * 2 * h + pair % h; /* the pair's first row: i & h == 0 */ \
                T a = r[i], b = r[i + h];                                          \
                r[i] = __builtin_shuffle(a, b, lo[stage]);                         \
                r[i + h] = __builtin_shuffle(a, b, hi[stage]);                     \
            }                                                                      \
        }                                                                          \
    }
TRANSPOSE(transpose, vf, vi)
TRANSPOSE(transpose_bits, hv, hv)

static int row_end(const Job *j, int b, int qi) {
    if (!j->keep) return j->nk - j->nq + qi + 1;
    const uint8_t *m = j->keep + b * j->skeep[0] + qi * j->skeep[1];
    int end = j->nk;
    while (end > 0 && !m[end - 1]) end--;
    return end;
}

/* One past the last key of rows row..row + n of the item. */
static inline int span(const Item *it, int row, int n) {
    int end = 0;
    for (int r = row; r < row + n && r < it->n; r++) end = it->ends[r] > end ? it->ends[r] : end;
    return end;
}

/* Keys at..at + LANES as block `b` of it->kt (d, LANES): float32, transposed, zeros past stop. */
static void keys_across(const Item *it, int at, int b) {
    const Job *j = it->j;
    float *kt = it->kt + (size_t)b * it->dp * LANES;
    int64_t first = it->b * j->sk[0] + it->kvh * j->sk[1] + (int64_t)at * j->sk[2];
    for (int c = 0; c < it->dp; c += LANES) {
        vf rows[LANES];
        int n = j->d - c < LANES ? j->d - c : LANES;
        if (n == LANES && j->fmt == F_BF16) {  /* the bits transposed, then widened */
            hv bits[LANES];
            for (int l = 0; l < LANES; l++) {
                bits[l] = (hv){0};
                if (at + l < it->stop) memcpy(&bits[l], (const uint16_t *)j->k + first + l * j->sk[2] + c, sizeof(hv));
            }
            transpose_bits(bits);
            for (int i = 0; i < LANES; i++) put(kt + (c + i) * LANES, (vf)(__builtin_convertvector(bits[i], vi) << 16));
            continue;
        }
        for (int l = 0; l < LANES; l++)
            rows[l] = at + l < it->stop ? take(j->k, first + l * j->sk[2] + c, n, j->fmt) : splat(0.0f);
        transpose(rows);
        for (int i = 0; i < n; i++) put(kt + (c + i) * LANES, rows[i]);
    }
}

/* Rows row..row + R's sums against keys at..at + LANES (those past the item's last row are not
 * kept), scaled, capped and masked to -inf, as their scores. */
static inline __attribute__((always_inline)) void keep_scores(const Item *it, int row, int at, const vf *acc, const int R) {
    const Job *j = it->j;
    vi keys;
    for (int l = 0; l < LANES; l++) keys[l] = at + l;
    for (int r = 0; r < R && row + r < it->n; r++) {
        int qi = (it->first + row + r) / (j->heads / j->kv_heads);
        vf x = acc[r] * j->scale;
        if (j->softcap > 0)
            for (int l = 0; l < LANES; l++) x[l] = tanhf(x[l] / j->softcap) * j->softcap;
        vi on = keys < it->stop;
        if (j->keep) {
            const uint8_t *m = j->keep + it->b * j->skeep[0] + qi * j->skeep[1];
            for (int l = 0; l < LANES; l++) on[l] = on[l] && m[at + l] ? -1 : 0;
        } else {
            on &= keys <= j->nk - j->nq + qi;
        }
        put(it->s + (int64_t)(row + r) * it->width + at, pick(on, x, splat(-INFINITY)));
    }
}

/* The scores of rows row..row + R against the B blocks of keys from `at` in it->kt; a block past
 * every one of the rows' keys is never read, so not kept. Each score is its own sum over the
 * head, index by index, however many blocks and rows share the loop. */
static inline __attribute__((always_inline)) void scores_of(const Item *it, int row, int at, const int R, const int B) {
    int end = span(it, row, R);
    if (at >= end) return;
    const float *q = it->qt + row * it->dp;  /* (d, R) */
    vf acc[BLOCKS][ROWS];
    for (int b = 0; b < B; b++)
        for (int r = 0; r < R; r++) acc[b][r] = splat(0.0f);
    for (int i = 0; i < it->j->d; i++) {
        vf k[BLOCKS];
        for (int b = 0; b < B; b++) k[b] = get(it->kt + ((size_t)b * it->dp + i) * LANES);
        for (int r = 0; r < R; r++) {
            vf x = splat(q[i * R + r]);
            for (int b = 0; b < B; b++) acc[b][r] += x * k[b];
        }
    }
    for (int b = 0; b < B && at + b * LANES < end; b++) keep_scores(it, row, at + b * LANES, acc[b], R);
}

/* The blocks of keys scored in one loop by groups of rg rows. */
static inline int blocks_for(int rg) { return rg <= 4 ? BLOCKS : 1; }

/* scores_of for the item's rows per group: each count compiled apart, so the loops unroll (a decode
 * step's item holds the query heads of one key head: one row for most models, 2-8 under grouped
 * queries, and more rows per group would only add zeros). */
static void block_scores(const Item *it, int row, int at) {
    switch (it->rg) {
    case 1: scores_of(it, row, at, 1, BLOCKS); break;
    case 2: scores_of(it, row, at, 2, BLOCKS); break;
    case 3: scores_of(it, row, at, 3, BLOCKS); break;
    case 4: scores_of(it, row, at, 4, BLOCKS); break;
    default: scores_of(it, row, at, ROWS, 1);
    }
}

/* Each row's scores become weights exp(score - max), and total[] their sums. */
static void weigh(const Item *it) {
    for (int r = 0; r < it->n; r++) {
        float *s = it->s + (int64_t)r * it->width;
        int width = (span(it, r / it->rg * it->rg, it->rg) + LANES - 1) / LANES * LANES;
        vf top = splat(-INFINITY), sum = splat(0.0f);
        for (int at = 0; at < width; at += LANES) {
            vf x = get(s + at);
            top = pick(x > top, x, top);
        }
        float m = -INFINITY;
        for (int l = 0; l < LANES; l++) m = top[l] > m ? top[l] : m;
        for (int at = 0; at < width; at += LANES) {  /* a row with no key to attend: zeros */
            vf w = m == -INFINITY ? splat(0.0f) : expv(get(s + at) - m);
            put(s + at, w);
            sum += w;
        }
        it->total[r] = sumv(sum);
    }
}

/* acc[row] += the weights of keys at..at + keys times their values, key by key; R rows at a
 * time share each load of a value (rows past the item's last have weights 0), and C blocks of
 * columns share each weight. */
static inline __attribute__((always_inline)) void add_rows(const Item *it, int at, int keys, const int R, const int C,
                                                          const int fmt, const int whole) {
    const Job *j = it->j;
    for (int r = 0; r < it->n; r += R) {
        if (at >= span(it, r, R)) continue;  /* the rows' weights here are 0 */
        const float *w = it->s + (int64_t)r * it->width + at;
        float *out = it->acc + r * it->dp;
        for (int c = 0; c < it->dp; c += C * LANES) {
            vf a[COLUMNS][ROWS];
            for (int b = 0; b < C; b++)
                for (int k = 0; k < R; k++) a[b][k] = get(out + k * it->dp + c + b * LANES);
            int n = whole || j->d - c >= LANES ? LANES : j->d - c;
            int64_t v = it->b * j->sv[0] + it->kvh * j->sv[1] + (int64_t)at * j->sv[2] + c;
            for (int l = 0; l < keys; l++, v += j->sv[2]) {
                vf x[COLUMNS];
                for (int b = 0; b < C; b++) x[b] = take(j->v, v + b * LANES, n, fmt);
                for (int k = 0; k < R; k++) {
                    vf weight = splat(w[k * it->width + l]);
                    for (int b = 0; b < C; b++) a[b][k] += weight * x[b];
                }
            }
            for (int b = 0; b < C; b++)
                for (int k = 0; k < R; k++) put(out + k * it->dp + c + b * LANES, a[b][k]);
        }
    }
}

/* add_rows with the key count, the rows per group and the format as constants where they are
 * common: the loops unroll, a value's widening is one shift, and groups of up to 4 rows take two
 * blocks of columns at a time (more independent sums). */
static inline __attribute__((always_inline)) void add_rows_of(const Item *it, int at, int keys, const int R) {
    const Job *j = it->j;
    int whole = keys == LANES && j->fmt == F_BF16;
    if (whole && j->d % (COLUMNS * LANES) == 0 && R <= 4) add_rows(it, at, LANES, R, COLUMNS, F_BF16, 1);
    else if (whole && j->d % LANES == 0) add_rows(it, at, LANES, R, 1, F_BF16, 1);
    else add_rows(it, at, keys, R, 1, j->fmt, 0);
}

static void add_values(const Item *it, int at) {
    int keys = it->stop - at < LANES ? it->stop - at : LANES;
    switch (it->rg) {
    case 1: add_rows_of(it, at, keys, 1); break;
    case 2: add_rows_of(it, at, keys, 2); break;
    case 3: add_rows_of(it, at, keys, 3); break;
    case 4: add_rows_of(it, at, keys, 4); break;
    default: add_rows_of(it, at, keys, ROWS);
    }
}

/* Row `row` of the item's key head: query head *h at position *qi (rows run position-major, so
 * a block of rows ends where its last position's keys do). */
static inline void row_at(const Item *it, int row, int *h, int *qi) {
    int groups = it->j->heads / it->j->kv_heads;
    *h = it->kvh * groups + (it->first + row) % groups;
    *qi = (it->first + row) / groups;
}

static void run_item(Item *it) {
    const Job *j = it->j;
    it->stop = 0;
    for (int r = 0, h, qi; r < it->n; r++) {
        row_at(it, r, &h, &qi);
        load(it->qf + r * it->dp, j->q, it->b * j->sq[0] + h * j->sq[1] + qi * j->sq[2], j->d, it->dp, j->fmt);
        it->ends[r] = row_end(j, it->b, qi);
        it->stop = it->ends[r] > it->stop ? it->ends[r] : it->stop;
    }
    int rg = it->n >= ROWS ? ROWS : it->n > 4 ? 4 : it->n;  /* the rows' arithmetic is the same for any */
    it->rg = rg;
    int whole = (it->n + rg - 1) / rg * rg;  /* rows past the last: zeros, weighing nothing */
    memset(it->qf + it->n * it->dp, 0, sizeof(float) * (whole - it->n) * it->dp);
    for (int r = 0; r < whole; r++)
        for (int i = 0; i < it->dp; i++) it->qt[(r / rg * it->dp + i) * rg + r % rg] = it->qf[r * it->dp + i];
    it->width = (it->stop + LANES - 1) / LANES * LANES;
    int blocks = blocks_for(rg);
    for (int at = 0; at < it->width; at += blocks * LANES) {
        for (int b = 0; b < blocks; b++) keys_across(it, at + b * LANES, b);  /* past stop: zeros */
        for (int row = 0; row < it->n; row += rg) block_scores(it, row, at);
    }
    weigh(it);
    memset(it->s + (int64_t)it->n * it->width, 0, sizeof(float) * (whole - it->n) * it->width);
    memset(it->acc, 0, sizeof(float) * whole * it->dp);
    for (int at = 0; at < it->stop; at += LANES) add_values(it, at);
    for (int r = 0, h, qi; r < it->n; r++) {
        row_at(it, r, &h, &qi);
        float inv = it->total[r] > 0 ? 1.0f / it->total[r] : 0.0f;
        for (int c = 0; c < it->dp; c += LANES) put(it->acc + r * it->dp + c, get(it->acc + r * it->dp + c) * inv);
        store(j->out, (((int64_t)it->b * j->nq + qi) * j->heads + h) * j->d, it->acc + r * it->dp, j->d, j->fmt);
    }
}

/* Runs `job` on `threads` threads. Returns 0, or -1 where working memory could not be had. */
int meshnet_attention(const Job *job, int threads) {
    int rows = job->heads / job->kv_heads * job->nq, dp = (job->d + LANES - 1) / LANES * LANES;
    int64_t heads = (int64_t)job->b * job->kv_heads;
    int64_t splits = heads >= 2 * threads ? 1 : (2 * threads + heads - 1) / heads;
    int per = ((rows + splits - 1) / splits + ROWS - 1) / ROWS * ROWS;
    per = per < MAX_ROWS ? per : MAX_ROWS;
    int parts = (rows + per - 1) / per;
    int64_t width = (job->nk + LANES - 1) / LANES * LANES;
    size_t floats = (size_t)per * dp * 3 + (size_t)dp * LANES * BLOCKS + (size_t)per * width + 2 * (size_t)per;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|| : failed)
    {
        float *work = malloc(sizeof(float) * floats);
        failed = work == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < heads * parts; item++) {
            if (!work) continue;
            Item it = {.j = job, .b = (int)(item / parts / job->kv_heads), .kvh = (int)(item / parts % job->kv_heads),
                       .first = (int)(item % parts) * per, .dp = dp};
            it.n = rows - it.first < per ? rows - it.first : per;
            it.qf = work;
            it.qt = it.qf + (size_t)per * dp;
            it.acc = it.qt + (size_t)per * dp;
            it.kt = it.acc + (size_t)per * dp;
            it.total = it.kt + (size_t)dp * LANES * BLOCKS;
            it.ends = (int *)(it.total + per);
            it.s = it.total + 2 * per;
            run_item(&it);
        }
        free(work);
    }
    return failed ? -1 : 0;
}
