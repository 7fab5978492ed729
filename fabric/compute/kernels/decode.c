/* A decode pass over a shard's llama layers in one call: for each layer, the same kernel calls
 * that fabric/compute/lean_layers.py makes one by one from Python, in the same order, on the same
 * bytes, so the bits are theirs (tests/test_decode_pass.py compares them).
 *
 * A lean layer of a one-token step is about twenty Python-level calls (a norm, the q/k/v product,
 * views, the rotary embedding, the cache's append, the attention, what follows it); on a slow
 * core each costs a few microseconds before it computes anything, which at SmolLM2's size is as
 * long as the layer's products. Here a pass of one or more rows (one new position each) is:
 *   normed = norm1(x)                       kernels/lean.c's meshnet_rms_norm
 *   qkv = qkv_proj(normed)                  kernels/q8dot.c's meshnet_q8dot
 *   (qwen2: plus its bias; qwen3: q and k heads normed, kernels/lean.c's meshnet_rms_norm)
 *   qk = rope(qkv's q and k heads)          kernels/lean.c's meshnet_rope
 *   the new k (from qk) and v (from qkv) copied into the layer's cache lines
 *   a = attention(q, the cache)             kernels/attention.c's meshnet_attention
 *   x = o, residual, norm2, MLP, residual   kernels/q8dot.c's meshnet_q8dot_after_attention
 * Those live in libraries of their own, so they come by address (the Python side hands them over
 * with the structures below, which mirror the libraries' own).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F_BF16 = 0 };

typedef struct { /* kernels/q8dot.c's DJob */
    const uint8_t *w;
    const void *x;
    void *y;
    int64_t rows, in, out;
    int kind, xfmt, yfmt;
} DJob;

typedef int (*NormFn)(const uint16_t *x, int64_t rows, int64_t n, int64_t groups, int64_t x_stride, int64_t x_run,
                      const uint16_t *weight, float eps, int lanes, uint16_t *out);

typedef struct { /* kernels/q8dot.c's NormArgs */
    NormFn fn;
    const uint16_t *weight;
    float eps;
    int lanes;
} NormArgs;

typedef struct { /* kernels/attention.c's Job */
    const void *q, *k, *v;
    const uint8_t *keep;
    void *out;
    int64_t sq[3], sk[3], sv[3];
    int64_t skeep[2];
    int b, heads, kv_heads, nq, nk, d, fmt;
    float scale, softcap;
} AttnJob;

typedef void (*RopeFn)(const uint16_t *x, int64_t b, int64_t s_len, int64_t heads, int64_t d, int64_t x_row,
                       const uint16_t *cos, const uint16_t *sin, int64_t cs_b, int64_t cs_s, uint16_t *out);
typedef int (*DotFn)(const DJob *job, int threads);
typedef int (*AfterFn)(const DJob *o, const uint16_t *x, const NormArgs *norm, const DJob *gate_up, const DJob *down,
                       const uint16_t *silu, const int threads[3]);
typedef int (*AttendFn)(const AttnJob *job, int threads);
typedef void (*BiasFn)(uint16_t *y, const uint16_t *bias, int64_t rows, int64_t n);

typedef struct { /* one layer: its norms and products, and where its cache lies */
    NormArgs norm1, norm2;
    NormArgs qk_norm;               /* qwen3: a weight row per q and k head; fn NULL: none */
    const uint16_t *bias;           /* qwen2: q/k/v's bias, bfloat16; NULL: none */
    DJob *qkv, *o, *gate_up, *down; /* the products' jobs: x, y and rows are set here */
    uint16_t *keys, *values;        /* the cache's buffers, seen as (lines, d) */
    float scale;
} Layer;

typedef struct {
    NormFn norm;
    RopeFn rope;
    DotFn dot;
    AfterFn after;
    AttendFn attend;
    BiasFn add_bias;                 /* kernels/q8dot.c's meshnet_q8dot_add_bias */
    const uint16_t *silu;            /* meshnet_q8dot_after_attention's table */
    const uint16_t *cos, *sin;       /* meshnet_rope's tables and their strides */
    int64_t cs_b, cs_s;
    const int64_t *lines;            /* (b, kv_heads): the line each row's new key and value go to */
    int64_t first;                   /* the element of a buffer where the attention's row 0 starts */
    int64_t sk[3];                   /* the buffers' strides: row, head, position */
    const uint8_t *keep;             /* attention.c's keep (NULL: causal) and its strides */
    int64_t skeep[2];
    int64_t b, hidden, heads, kv_heads, d, width; /* width: the positions attention reads */
    int threads[5];                  /* q/k/v, attention, o, gate/up, down */
    const uint16_t *x;               /* (b, hidden) in */
    uint16_t *out;                   /* (b, hidden) out */
} Pass;

/* The new keys (from qk, after rotation) and values (from qkv) of each row into the cache lines. */
static void put(const Pass *p, const Layer *l, const uint16_t *qk, const uint16_t *qkv) {
    const int64_t d = p->d, qk_row = (p->heads + p->kv_heads) * d, qkv_row = (p->heads + 2 * p->kv_heads) * d;
    for (int64_t r = 0; r < p->b; r++)
        for (int64_t h = 0; h < p->kv_heads; h++) {
            int64_t line = p->lines[r * p->kv_heads + h] * d;
            memcpy(l->keys + line, qk + r * qk_row + (p->heads + h) * d, (size_t)d * 2);
            memcpy(l->values + line, qkv + r * qkv_row + (p->heads + p->kv_heads + h) * d, (size_t)d * 2);
        }
}

/* Attention of each row's query (qk's first heads) over the layer's cache, into a (b, heads * d). */
static int attend(const Pass *p, const Layer *l, const uint16_t *qk, uint16_t *a) {
    const int64_t qk_row = (p->heads + p->kv_heads) * p->d;
    AttnJob job = {qk, l->keys + p->first, l->values + p->first, p->keep, a,
                   {qk_row, p->d, qk_row}, {p->sk[0], p->sk[1], p->sk[2]}, {p->sk[0], p->sk[1], p->sk[2]},
                   {p->skeep[0], p->skeep[1]}, (int)p->b, (int)p->heads, (int)p->kv_heads, 1, (int)p->width,
                   (int)p->d, F_BF16, l->scale, 0.0f};
    return p->attend(&job, p->threads[1]);
}

/* One layer over x (b, hidden) into y; s is scratch for normed, qkv, qk, a and qk_normed. */
static int layer(const Pass *p, const Layer *l, const uint16_t *x, uint16_t *y, uint16_t *s) {
    const int64_t b = p->b, n = p->hidden, d = p->d;
    uint16_t *normed = s, *qkv = normed + b * n, *qk = qkv + b * l->qkv->out;
    uint16_t *a = qk + b * (p->heads + p->kv_heads) * d, *qk_normed = a + b * p->heads * d;
    if (p->norm(x, b, n, 1, n, n, l->norm1.weight, l->norm1.eps, l->norm1.lanes, normed))
        return -2;
    l->qkv->x = normed, l->qkv->y = qkv, l->qkv->rows = b, l->qkv->xfmt = l->qkv->yfmt = F_BF16;
    int rc = p->dot(l->qkv, p->threads[0]);
    if (rc) return rc;
    if (l->bias) p->add_bias(qkv, l->bias, b, l->qkv->out);
    const int64_t qk_heads = p->heads + p->kv_heads;
    const uint16_t *turned = qkv; /* what the rotary embedding reads: qkv's q and k heads, or them normed */
    if (l->qk_norm.fn) {
        if (l->qk_norm.fn(qkv, b * qk_heads, d, qk_heads, d, l->qkv->out, l->qk_norm.weight, l->qk_norm.eps,
                          l->qk_norm.lanes, qk_normed))
            return -2;
        turned = qk_normed;
    }
    const int64_t row = turned == qkv ? l->qkv->out : qk_heads * d;
    p->rope(turned, b, 1, qk_heads, d, row, p->cos, p->sin, p->cs_b, p->cs_s, qk);
    put(p, l, qk, qkv);
    if (attend(p, l, qk, a)) return -1;
    l->o->x = a, l->o->rows = b, l->o->xfmt = F_BF16;
    l->down->y = y, l->down->rows = b;
    return p->after(l->o, x, &l->norm2, l->gate_up, l->down, p->silu, p->threads + 2);
}

/* The pass over `count` layers: p->x in, p->out out. Returns 0, or the first failing call's code
 * (-1: no memory, -2: a width the norm does not take). */
int meshnet_decode_layers(const Pass *p, const Layer *layers, int count) {
    const int64_t b = p->b, n = p->hidden, qkv = (p->heads + 2 * p->kv_heads) * p->d; /* every layer's q/k/v */
    const int64_t scratch = b * (n + qkv + 2 * (p->heads + p->kv_heads) * p->d + p->heads * p->d);
    uint16_t *s = malloc(sizeof(uint16_t) * (size_t)(scratch + 2 * b * n));
    if (!s) return -1;
    uint16_t *turn[2] = {s + scratch, s + scratch + b * n};
    const uint16_t *x = p->x;
    int rc = 0;
    for (int i = 0; rc == 0 && i < count; i++) {
        uint16_t *y = i == count - 1 ? p->out : turn[i % 2];
        rc = layer(p, &layers[i], x, y, s);
        x = y;
    }
    free(s);
    return rc;
}
