/* A MoE layer's routed experts: one projection of every expert in one loop (moe_matmul), and a
 * block from its input to its output in one call (kvc_moe_glu), whatever kind the experts'
 * weights are (int4 as rows or panels, int8, MXFP4: each family's moe_project). */
#include "kvc.h"

/* One projection's units in one loop, each thread with its scratch (freed at the end). */
typedef struct {
    moe_project project; const moe_proj *p; const moe_unit *units; const int64_t *starts; int64_t out, cols;
    const int8_t *xq; const float *xd, *xs; float *y; void **scratch;
} moe_call;

static void moe_units_body(void *ctx, int64_t u0, int64_t u1, int thread) {
    const moe_call *c = ctx;
    c->project(c->p, c->units, u0, u1, c->starts, c->out, c->cols, c->xq, c->xd, c->xs, c->y, &c->scratch[thread]);
}

static void moe_loop(moe_project project, const moe_proj *p, const moe_unit *units, int64_t count, int chunk,
                     const int64_t *starts, int64_t out, int64_t cols, const int8_t *xq, const float *xd,
                     const float *xs, float *y, int threads) {
    void *scratch[POOL_THREADS] = {0};
    moe_call c = {project, p, units, starts, out, cols, xq, xd, xs, y, scratch};
    pool_for(threads, count, chunk, moe_units_body, &c);
    free_scratch(scratch, threads > 0 ? threads : 1);
}

int moe_matmul(moe_project project, const moe_proj *p, const int64_t *starts, int64_t experts, int64_t out,
               int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y, int threads) {
    int64_t count;
    moe_unit *units = moe_units(starts, experts, (out + 7) / 8, p->panels ? q4_panel_step() : 1, &count);
    if (!units) return -1;
    moe_loop(project, p, units, count, moe_chunk(starts, experts), starts, out, cols, xq, xd, xs, y, threads);
    free(units);
    return 0;
}

/* The gating between an expert's projections, from its gate-up output (plus its bias, if any):
 * with the gate half first, then the up half, SiLU (Qwen MoE) or GELU's tanh form (Gemma 4),
 * act(g) * u; with gate and up interleaved (even and odd outputs), gpt-oss's clamped form,
 * (min(u, limit) clamped below at -limit, + 1) * g' * sigmoid(alpha g'), g' = min(g, limit).
 * exp8's rounding, not torch's: the KV namespace names it. */
#define GLU_SILU 0
#define GLU_GELU_TANH 1
#define GLU_CLAMPED 2

typedef struct { int act; float alpha, limit; } gating;

static inline __m256 load_biased(const float *v, const float *bias, int64_t i) {
    const __m256 x = _mm256_loadu_ps(v + i);
    return bias ? _mm256_add_ps(x, _mm256_loadu_ps(bias + i)) : x;
}

/* A slot's gate-up output gu [2 x inner] (its bias gb, or NULL) gated into h [inner]. */
static inline void glu_row(const float *gu, const float *gb, int64_t inner, gating gt, float *h) {
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    for (int64_t i = 0; i < inner; i += 8) {
        __m256 g, u, a;
        if (gt.act == GLU_CLAMPED) {  /* 16 values g0 u0 g1 u1 ..., split into gates and ups */
            const __m256 lo = load_biased(gu, gb, 2 * i), hi = load_biased(gu, gb, 2 * i + 8);
            /* per 128-bit lane: even (odd) elements of lo, then of hi; then the lanes in order */
            g = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xD8));
            u = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8));
            const __m256 limit = _mm256_set1_ps(gt.limit);
            g = _mm256_min_ps(g, limit);
            u = _mm256_max_ps(_mm256_min_ps(u, limit), _mm256_sub_ps(_mm256_setzero_ps(), limit));
            const __m256 z = _mm256_mul_ps(g, _mm256_set1_ps(gt.alpha));
            a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
            u = _mm256_add_ps(u, one);
        } else {
            g = load_biased(gu, gb, i);
            u = load_biased(gu + inner, gb ? gb + inner : NULL, i);
            if (gt.act == GLU_SILU) {  /* g / (1 + exp(-g)) */
                a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            } else {  /* 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), tanh(z) = 1 - 2 / (exp(2z) + 1) */
                const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
                const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                               _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
                const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                                  _mm256_add_ps(exp8(_mm256_add_ps(z, z)), one)));
                a = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t));
            }
        }
        _mm256_storeu_ps(h + i, _mm256_mul_ps(a, u));
    }
}

/* A slot's gate-up output gated into h, then quantized (xq, xd, xs: its row). */
static inline void gate_slot(const float *gu, const float *gb, int64_t inner, gating gt, float *h, int8_t *xq,
                             float *xd, float *xs) {
    glu_row(gu, gb, inner, gt, h);
    for (int64_t b = 0; b < inner / BLOCK; b++) quantize_block(h + b * BLOCK, xq + b * BLOCK, xd + b, xs + b);
}

#define MOE_Q4 0
#define MOE_Q4_PANELS 1
#define MOE_Q8 2
#define MOE_MXFP4 3
#define MOE_MXFP4_PANELS 4

/* kvc_moe_glu's per-slot and per-token work: slots grouped by expert (pos: a slot's place, token
 * and expert: a place's), their activations, outputs and the block's output. */
typedef struct {
    const float *x; const int64_t *token, *expert, *pos; const float *weights, *gb, *db; int64_t cols, inner, k;
    gating gt; int8_t *xq1; float *xd1, *xs1, *y1; int8_t *xq2; float *xd2, *xs2, *y2, *y;
    float *h;  /* a gating row of inner floats a thread */
} slot_call;

static void quantize_slots(void *ctx, int64_t p0, int64_t p1, int thread) {
    (void)thread;
    const slot_call *c = ctx;
    const int64_t cols = c->cols, cb = cols / BLOCK;
    for (int64_t p = p0; p < p1; p++)
        for (int64_t b = 0; b < cb; b++)
            quantize_block(c->x + c->token[p] * cols + b * BLOCK, c->xq1 + p * cols + b * BLOCK, c->xd1 + p * cb + b,
                           c->xs1 + p * cb + b);
}

static void gate_slots(void *ctx, int64_t p0, int64_t p1, int thread) {
    const slot_call *c = ctx;
    const int64_t inner = c->inner, wide = 2 * inner, ib = inner / BLOCK;
    for (int64_t p = p0; p < p1; p++)
        gate_slot(c->y1 + p * wide, c->gb ? c->gb + c->expert[p] * wide : NULL, inner, c->gt, c->h + thread * inner,
                  c->xq2 + p * inner, c->xd2 + p * ib, c->xs2 + p * ib);
}

/* y of tokens t0..t1-1: the sum over each token's experts, in its own order, of weight x output. */
static void sum_tokens(void *ctx, int64_t t0, int64_t t1, int thread) {
    (void)thread;
    const slot_call *c = ctx;
    const int64_t cols = c->cols, k = c->k;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t col = 0; col < cols; col += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < k; j++) {
                const int64_t p = c->pos[t * k + j];
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(c->weights[t * k + j]),
                                                       load_biased(c->y2 + p * cols,
                                                                   c->db ? c->db + c->expert[p] * cols : NULL, col)));
            }
            _mm256_storeu_ps(c->y + t * cols + col, acc);
        }
}

/* A MoE block's routed experts from the block's input to its output in one call (a decode step
 * woke the threads and ran ~20 torch operations a layer for this, as long as the experts' own
 * reading): x float32 [tokens, cols], each token's k experts index [tokens, k] (int64) with
 * their weights [tokens, k]; expert e's gate-up weight (gw/gs/go[e], 2 x inner rows laid out
 * for `act`; offsets only for int4, 0 where kept panels derive them; its bias gb + e x 2 inner,
 * or gb NULL) and down weight (dw/ds/dof[e], cols rows of inner inputs; bias db + e x cols), of
 * `kind` (MOE_*). Each (token, expert) slot is quantized, multiplied by its expert's gate-up,
 * gated (`act`: GLU_*, with alpha and limit for GLU_CLAMPED), quantized and multiplied by its
 * expert's down projection, every product by its linear's arithmetic; y [tokens, cols] = the
 * sum over the token's experts in its own order of weight x output. A slot's numbers are its
 * own whatever else shares the step. */
int kvc_moe_glu(int kind, const float *x, int64_t tokens, int64_t cols, const int64_t *index, const float *weights,
                int64_t k, int64_t experts, const int64_t *gw, const int64_t *gs, const int64_t *go, const float *gb,
                const int64_t *dw, const int64_t *ds, const int64_t *dof, const float *db, int64_t inner, int act,
                float alpha, float limit, float *y, int threads) {
    static const moe_project projects[] = {moe_q4_project, moe_q4_project, moe_q8_project, moe_mx_project,
                                           moe_mx_project};
    const int64_t slots = tokens * k, wide = 2 * inner, cb = cols / BLOCK, ib = inner / BLOCK;
    const int panels = kind == MOE_Q4_PANELS || kind == MOE_MXFP4_PANELS;
    if (tokens < 0 || k <= 0 || cols % BLOCK || inner % BLOCK || act < GLU_SILU || act > GLU_CLAMPED || kind < MOE_Q4
        || kind > MOE_MXFP4_PANELS || (panels && (wide % 8 || cols % 8)))
        return -2;
    for (int64_t s = 0; s < slots; s++)
        if (index[s] < 0 || index[s] >= experts) return -2;
    const moe_project project = projects[kind];
    const moe_proj up_proj = {gw, gs, go, panels}, down_proj = {dw, ds, dof, panels};
    const gating gt = {act, alpha, limit};
    int64_t *starts = calloc((size_t)experts + 1, sizeof(int64_t)), *next = malloc(((size_t)experts + 1) * sizeof(int64_t));
    int64_t *pos = malloc((size_t)(slots + 1) * sizeof(int64_t)), *token = malloc((size_t)(slots + 1) * sizeof(int64_t));
    int64_t *expert = malloc((size_t)(slots + 1) * sizeof(int64_t));
    int8_t *xq1 = malloc((size_t)(slots * cols + 1)), *xq2 = malloc((size_t)(slots * inner + 1));
    float *xd1 = malloc((size_t)(slots * cb + 1) * sizeof(float)), *xs1 = malloc((size_t)(slots * cb + 1) * sizeof(float));
    float *xd2 = malloc((size_t)(slots * ib + 1) * sizeof(float)), *xs2 = malloc((size_t)(slots * ib + 1) * sizeof(float));
    float *y1 = malloc((size_t)(slots * wide + 1) * sizeof(float)), *y2 = malloc((size_t)(slots * cols + 1) * sizeof(float));
    moe_unit *units1 = NULL, *units2 = NULL;
    float *own_f = NULL;
    int64_t n1 = 0, n2 = 0;
    int rc = -1;
    if (!starts || !next || !pos || !token || !expert || !xq1 || !xq2 || !xd1 || !xs1 || !xd2 || !xs2 || !y1 || !y2)
        goto done;
    /* the slots grouped by expert, in their order within each expert */
    for (int64_t s = 0; s < slots; s++) starts[index[s] + 1]++;
    for (int64_t e = 0; e < experts; e++) starts[e + 1] += starts[e];
    memcpy(next, starts, ((size_t)experts + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < slots; s++) {
        pos[s] = next[index[s]]++;
        token[pos[s]] = s / k;
        expert[pos[s]] = index[s];
    }
    const int64_t step = panels ? q4_panel_step() : 1;
    units1 = moe_units(starts, experts, (wide + 7) / 8, step, &n1);
    units2 = moe_units(starts, experts, (cols + 7) / 8, step, &n2);
    if (!units1 || !units2) goto done;
    const int chunk = moe_chunk(starts, experts);
    /* A decode step's slots are few: their quantization, gating and sum take microseconds, less
     * than handing them to other threads, so they run on the calling thread. Each slot's numbers
     * are the same whoever computes them. */
    const int few = slots * (cols + inner) <= 65536;
    slot_call c = {x, token, expert, pos, weights, gb, db, cols, inner, k, gt, xq1, xd1, xs1, y1, xq2, xd2, xs2, y2, y,
                   NULL};
    pool_for(few ? 1 : threads, slots, 1, quantize_slots, &c);
    moe_loop(project, &up_proj, units1, n1, chunk, starts, wide, cols, xq1, xd1, xs1, y1, threads);
    own_f = malloc((size_t)(threads > 0 ? threads : 1) * inner * sizeof(float) + 1);  /* a gating row a thread */
    if (!own_f) goto done;
    c.h = own_f;
    pool_for(few ? 1 : threads, slots, 1, gate_slots, &c);
    moe_loop(project, &down_proj, units2, n2, chunk, starts, cols, inner, xq2, xd2, xs2, y2, threads);
    pool_for(few ? 1 : threads, tokens, 1, sum_tokens, &c);
    rc = 0;
done:
    free(starts); free(next); free(pos); free(token); free(expert); free(xq1); free(xq2);
    free(xd1); free(xs1); free(xd2); free(xs2); free(y1); free(y2); free(units1); free(units2);
    free(own_f);
    return rc;
}
