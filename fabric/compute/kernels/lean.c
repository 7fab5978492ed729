/* A lean layer's row operations in one call each, with torch's own arithmetic, bit for bit.
 *
 * On a slow core a torch operator costs 4-6 us before it computes anything, and transformers'
 * RMSNorm is about ten of them (upcast, square, sum, divide, add, rsqrt, multiply, cast, the
 * weight's product): 50 us for 576 numbers. Here it is one call. Its arithmetic is ATen's:
 *   - the square of each upcast value, rounded to float32;
 *   - their sum in the order of ATen's cascade sum over a contiguous row (SumKernel.cpp:
 *     vectors of LANES floats, four at a time, in levels of 2^k vectors), where LANES is the
 *     width of ATen's Vectorized<float> on this CPU (8, or 16 with AVX-512): the caller says
 *     which, having checked both against torch (fabric/compute/lean_ops.py);
 *   - divided by the width, plus epsilon, 1 / sqrt of it; each value times that, rounded to
 *     bfloat16; times the weight, rounded to bfloat16.
 * The rotary embedding is x * cos + swap(x) * sin, each product and the sum rounded to
 * bfloat16 as torch's three operators round them.
 *
 * No product may fuse with a sum (an FMA rounds once where torch rounds twice), hence the
 * pragmas. Built once per machine by fabric/compute/native.py.
 */
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF
#include <stdint.h>
#include <string.h>
#include <math.h>

#define MAX_LANES 16
#define WIDEST 16384 /* floats of a row the norm holds on the stack (64 KB) */

static inline float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) { /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f)
        return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static int ceil_log2(int64_t x) { /* ATen's utils::CeilLog2 */
    if (x <= 2)
        return 1;
    return 64 - __builtin_clzll((uint64_t)(x - 1));
}

static inline void add_to(float *acc, const float *x, int lanes) {
    for (int l = 0; l < lanes; l++)
        acc[l] += x[l];
}

/* multi_row_sum of ATen over `size` rows of four vectors (row i: vectors 4i..4i+3), into
 * out[4][lanes]. */
static void four_sums(const float *x, int64_t size, int lanes, float out[4][MAX_LANES]) {
    const int power = ceil_log2(size) / 4 > 4 ? ceil_log2(size) / 4 : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[4][4][MAX_LANES] = {{{0}}}; /* level, row, lane */
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                add_to(acc[0][k], x + (i * 4 + k) * lanes, lanes);
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                add_to(acc[j][k], acc[j - 1][k], lanes);
                memset(acc[j - 1][k], 0, sizeof acc[j - 1][k]);
            }
            if (i & (mask << (j * power)))
                break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < 4; k++)
            add_to(acc[0][k], x + (i * 4 + k) * lanes, lanes);
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            add_to(acc[0][k], acc[j][k], lanes);
    memcpy(out, acc[0], sizeof acc[0]);
}

/* ATen's sum of the n >= lanes floats x, as its vectorized inner reduction adds them. */
static float cascade_sum(const float *x, int64_t n, int lanes) {
    const int64_t vectors = n / lanes, size = vectors / 4;
    float part[4][MAX_LANES];
    four_sums(x, size, lanes, part);
    for (int64_t t = size * 4; t < vectors; t++)
        add_to(part[0], x + t * lanes, lanes);
    for (int k = 1; k < 4; k++)
        add_to(part[0], part[k], lanes);
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < n; t++)
        total += x[t];
    for (int l = 0; l < lanes; l++)
        total += part[0][l];
    return total;
}

/* The sum of the squares of the n <= WIDEST bfloat16 values of row, each rounded to float32 (as
 * ATen's pow(2) of the upcast row), added in ATen's order. */
static float square_sum(const uint16_t *row, int64_t n, int lanes) {
    float sq[WIDEST];
    for (int64_t i = 0; i < n; i++)
        sq[i] = widen(row[i]) * widen(row[i]);
    return cascade_sum(sq, n, lanes);
}

/* sums[r] = the sum of the squares of row r of x (rows, n) bfloat16, contiguous, as the norm
 * adds them: what the caller compares with ATen's sum, float for float, before it uses the
 * norm (the norm's rounding to bfloat16 hides most differences of order). */
int meshnet_square_sums(const uint16_t *x, int64_t rows, int64_t n, int lanes, float *sums) {
    if (n < lanes || n > WIDEST || lanes < 1 || lanes > MAX_LANES)
        return 1;
    for (int64_t r = 0; r < rows; r++)
        sums[r] = square_sum(x + r * n, n, lanes);
    return 0;
}

/* out[r] = weight[r % groups] * rms_norm(x[r]) for rows r of n bfloat16 values: x's rows at
 * x_stride elements apart in runs of `groups` (a run's rows are consecutive, runs x_run
 * apart: the q and k heads of one position), weight (groups, n), out contiguous. Returns
 * nonzero for a shape it does not take. */
int meshnet_rms_norm(const uint16_t *x, int64_t rows, int64_t n, int64_t groups, int64_t x_stride, int64_t x_run,
                     const uint16_t *weight, float eps, int lanes, uint16_t *out) {
    if (n < lanes || n > WIDEST || lanes < 1 || lanes > MAX_LANES || groups < 1 || rows % groups)
        return 1;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + (r / groups) * x_run + (r % groups) * x_stride;
        const uint16_t *w = weight + (r % groups) * n;
        uint16_t *o = out + r * n;
        float mean = square_sum(row, n, lanes) / (float)n;
        float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < n; i++)
            o[i] = narrow(widen(w[i]) * widen(narrow(widen(row[i]) * scale)));
    }
    return 0;
}

/* out (b, s, heads, d) = x * cos + swap(x) * sin for x (b * s, heads, d) bfloat16, its rows
 * x_row elements apart, each head contiguous; cos and sin (b, s, d) bfloat16, their batch
 * rows cs_b and positions cs_s elements apart (the same strides for both); swap(x) is x with
 * its halves exchanged (sin carries rotate_half's sign). Every product and the sum rounded to
 * bfloat16. */
void meshnet_rope(const uint16_t *x, int64_t b, int64_t s_len, int64_t heads, int64_t d, int64_t x_row,
                  const uint16_t *cos, const uint16_t *sin, int64_t cs_b, int64_t cs_s, uint16_t *out) {
    const int64_t half = d / 2, rows = b * s_len;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = (r / s_len) * cs_b + (r % s_len) * cs_s;
        const uint16_t *c = cos + at, *s = sin + at;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *v = x + r * x_row + h * d;
            uint16_t *o = out + (r * heads + h) * d;
            for (int64_t i = 0; i < d; i++) {
                float turned = widen(narrow(widen(v[i < half ? i + half : i - half]) * widen(s[i])));
                o[i] = narrow(widen(narrow(widen(v[i]) * widen(c[i]))) + turned);
            }
        }
    }
}

/* A decode pass's new keys and values into the cache, one line of d 16-bit values per row and
 * head: line i = r * heads + h (r < rows, h < heads) comes from k + r * k_row + h * k_head (and
 * the same of v) and goes to keys + lines[i] * d (and values + lines[i] * d). A copy: the bits
 * stay as they were. */
void meshnet_put_lines(const uint16_t *k, int64_t k_row, int64_t k_head, const uint16_t *v, int64_t v_row,
                       int64_t v_head, int64_t rows, int64_t heads, int64_t d, const int64_t *lines,
                       uint16_t *keys, uint16_t *values) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            int64_t line = lines[r * heads + h] * d;
            memcpy(keys + line, k + r * k_row + h * k_head, (size_t)d * 2);
            memcpy(values + line, v + r * v_row + h * v_head, (size_t)d * 2);
        }
}

/* A count sketch of each of `rows` rows of `width` values (bfloat16 where is16, else float32),
 * rows `stride` elements apart: out[r][bucket[i]] += x[r][i] * sign[i], i in order, in float32,
 * out (rows, dim) zeroed here. The order of the additions is torch's index_add_ over the
 * columns, one after another, so the bits are too. */
void meshnet_sketch(const void *x, int is16, int64_t rows, int64_t width, int64_t stride, const int64_t *bucket,
                    const float *sign, int64_t dim, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * dim;
        for (int64_t j = 0; j < dim; j++)
            o[j] = 0.0f;
        if (is16) {
            const uint16_t *row = (const uint16_t *)x + r * stride;
            for (int64_t i = 0; i < width; i++)
                o[bucket[i]] += widen(row[i]) * sign[i];
        } else {
            const float *row = (const float *)x + r * stride;
            for (int64_t i = 0; i < width; i++)
                o[bucket[i]] += row[i] * sign[i];
        }
    }
}
