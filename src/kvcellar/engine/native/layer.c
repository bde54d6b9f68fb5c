/* A dense decoder's layers on the kernels, all of a step's in one foreign call: Llama's, Qwen2's
 * and Qwen3's norm -> QKV (-> Qwen3's per-head norms) -> RoPE -> K and V written to the pool ->
 * attention over it -> o -> residual -> norm -> gate/up -> silu(gate) x up -> down -> residual.
 * A decode step spent about a tenth of its time in Python and torch between a layer's ~10
 * kernel calls, more than the calls' arithmetic: after a kernel has streamed its weights, the
 * interpreter's code and data come back from memory. Each operation here is the one the lean
 * forward runs (engine/lean_forward.py), rounded where torch rounds it (a bf16 model after every
 * operation), so the two give the same bits and a step may take either. */
#include "kvc.h"

/* A call's scratch up to this size stays with the thread for its next call (decode and
 * verification steps); larger steps allocate theirs for the call. */
#define LAYER_KEEP (32 << 20)

/* v, or v rounded to bfloat16 where bf16 (torch rounds each bf16 operation's float result). */
static inline __m256 rounded(__m256 v, int bf16) { return bf16 ? round_bf16(v) : v; }

static inline __m256 load8(const void *p, int64_t at, int bf16) {
    return bf16 ? load8_bf16((const uint16_t *)p + at) : _mm256_loadu_ps((const float *)p + at);
}

/* transformers' rotate-half RoPE of one head, in place: x * cos + rotate_half(x) * sin, each
 * product and the sum rounded as torch's three operations round them (no fused multiply-add). */
__attribute__((optimize("fp-contract=off")))
static void rope_head(void *x, const void *cos, const void *sin, int64_t dim, int bf16) {
    const int64_t half = dim / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const dest out = {x, bf16};
    for (int64_t i = 0; i < half; i += 8) {
        const __m256 x1 = load8(x, i, bf16), x2 = load8(x, i + half, bf16);
        const __m256 lo = _mm256_add_ps(rounded(_mm256_mul_ps(x1, load8(cos, i, bf16)), bf16),
                                        rounded(_mm256_mul_ps(_mm256_xor_ps(x2, sign), load8(sin, i, bf16)), bf16));
        const __m256 hi = _mm256_add_ps(rounded(_mm256_mul_ps(x2, load8(cos, i + half, bf16)), bf16),
                                        rounded(_mm256_mul_ps(x1, load8(sin, i + half, bf16)), bf16));
        put8(out, i, lo);
        put8(out, i + half, hi);
    }
}

static inline AVX512 __attribute__((always_inline)) __m512 load16(const void *p, int64_t at, int bf16) {
    return bf16 ? load16_bf16((const uint16_t *)p + at) : _mm512_loadu_ps((const float *)p + at);
}

/* round_bf16 on 16 lanes. */
static inline AVX512 __attribute__((always_inline)) __m512 round_bf16_wide(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* silu_row's first n16 values (a multiple of 16), 16 lanes at a time by its operations. */
static AVX512 void silu_wide(const void *g, const void *u, int64_t n16, int bf16, void *out) {
    const dest d = {out, bf16};
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t i = 0; i < n16; i += 16) {
        const __m512 x = load16(g, i, bf16);
        const __m512 minus = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
        __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp16(minus)));
        if (u) s = _mm512_mul_ps(bf16 ? round_bf16_wide(s) : s, load16(u, i, bf16));
        put16_wide(d, i, s);
    }
}

/* silu(g) = g / (1 + exp(-g)) of n values (exp by exp8), rounded to the dtype; times u (then
 * rounded again) where u is given: the act's result, then torch's product with the up
 * projection. 16 at a time on AVX-512, the same bits. */
static void silu_row(const void *g, const void *u, int64_t n, int bf16, void *out) {
    const dest d = {out, bf16};
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    if (avx512_cpu()) {
        i = n / 16 * 16;
        silu_wide(g, u, i, bf16, out);
    }
    for (; i < n; i += 8) {
        const __m256 x = load8(g, i, bf16);
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
        if (u) s = _mm256_mul_ps(rounded(s, bf16), load8(u, i, bf16));
        put8(d, i, s);
    }
}

/* y[i] = y[i] + b[i] rounded, for n values (a residual, a bias). */
static void add_row(void *y, const void *b, int64_t n, int bf16) {
    const dest d = {y, bf16};
    for (int64_t i = 0; i < n; i += 8) put8(d, i, _mm256_add_ps(load8(y, i, bf16), load8(b, i, bf16)));
}

typedef struct { const uint8_t *x; uint8_t *out; int64_t cols, stride, size; int bf16; } silu_call;

static void silu_rows(void *ctx, int64_t r0, int64_t r1, int thread) {
    (void)thread;
    const silu_call *c = ctx;
    for (int64_t r = r0; r < r1; r++)
        silu_row(c->x + r * c->stride * c->size, NULL, c->cols, c->bf16, c->out + r * c->cols * c->size);
}

/* x [rows, cols] (rows `stride` values apart) through silu into out [rows, cols]: the act of a
 * gated MLP, for the steps that run it in torch (lean_forward's other paths, transformers'
 * modules), the numbers of this file's. cols a multiple of 8. */
void kvc_silu(const void *x, int bf16, int64_t rows, int64_t cols, int64_t stride, void *out, int threads) {
    silu_call c = {x, out, cols, stride, bf16 ? 2 : 4, bf16};
    pool_for(rows * cols > 65536 ? threads : 1, rows, 1, silu_rows, &c);
}

/* Linears that take x [rows, in] (kvc_linear's spec: one weight, or a group) into y [rows, sum
 * of outs] in the model's dtype (a group's outputs side by side in each row, as a fused weight's),
 * each part's bias then added where biases[i] is not 0: FastLinear's and call_together's
 * operations. int8 kernels write float32, rounded to bf16 after; a group's parts go to `wide`
 * first (rows x the outputs' floats). */
static int linear(const int64_t *spec, const int64_t *biases, const void *x, int64_t rows, void *y, float *wide,
                  int bf16, int threads) {
    const int64_t count = spec[1], *outs = spec + 3 + 3 * count, size = bf16 ? 2 : 4;
    const int direct = spec[0] == LINEAR_Q4P;  /* writes the model's dtype itself */
    if (count < 1 || count > 8) return -2;
    int64_t ys[8], total = 0;
    for (int64_t i = 0; i < count; i++) {
        ys[i] = (int64_t)((uint8_t *)wide + rows * total * (direct ? size : 4));
        total += outs[i];
    }
    if (count == 1 && direct) ys[0] = (int64_t)y;
    const int status = kvc_linear(spec, x, bf16, rows, ys, bf16, threads);
    if (status) return status;
    for (int64_t i = 0, at = 0; i < count; at += outs[i], i++) {
        if (!(count == 1 && direct))
            for (int64_t r = 0; r < rows; r++) {
                uint8_t *row = (uint8_t *)y + (r * total + at) * size;
                if (direct) {
                    memcpy(row, (const uint8_t *)ys[i] + r * outs[i] * size, (size_t)(outs[i] * size));
                } else {
                    const dest d = {row, bf16};
                    const float *part = (const float *)ys[i] + r * outs[i];
                    for (int64_t c = 0; c < outs[i]; c += 8) put8(d, c, _mm256_loadu_ps(part + c));
                }
            }
        if (biases[i])
            for (int64_t r = 0; r < rows; r++)
                add_row((uint8_t *)y + (r * total + at) * size, (const void *)biases[i], outs[i], bf16);
    }
    return 0;
}

/* spec: LAYER_FIELDS values a layer (layer_spec in native/layer.py builds them). */
int kvc_layer_fields(void) { return LAYER_FIELDS; }

/* h [rows, hidden] (float32, or bf16 where bf16) through `layers` layers in place. cos, sin
 * [rows, head_dim] in h's dtype (the rotary module's). The pool's blocks, K and V of a token
 * written at (slot_blocks[t], slot_offsets[t]): block_bytes apart, 16 or 32 bits a value as
 * stored, or quantized (bits 8 or 4, groups of `group`); attention as kvc_attend_kv's over
 * tables/contexts/seq_rows (the step's sequences in packed order) on attend_threads threads.
 * Returns 0, -1 without memory, -2 for a slot or spec out of bounds (nothing written). */
int kvc_dense_layers(const int64_t *spec, int64_t layers, void *h, int bf16, int64_t rows, const void *cos,
                     const void *sin, uint8_t *pool, int64_t n_blocks, int64_t block_size, int64_t block_bytes,
                     int64_t group, int bits, const int64_t *slot_blocks, const int64_t *slot_offsets,
                     const int64_t *tables, int64_t table_width, const int64_t *contexts, const int64_t *seq_rows,
                     int64_t n_seq, int attend_threads, int threads) {
    if (rows <= 0 || layers <= 0) return 0;
    for (int64_t t = 0; t < rows; t++)
        if (slot_blocks[t] < 0 || slot_blocks[t] >= n_blocks || slot_offsets[t] < 0 || slot_offsets[t] >= block_size)
            return -2;
    const int64_t size = bf16 ? 2 : 4;
    int64_t most_elems = 0, most_floats = 0;
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *s = spec + l * LAYER_FIELDS;
        const int64_t hidden = s[L_HIDDEN], qh = s[L_Q_HEADS], kvh = s[L_KV_HEADS], dim = s[L_HEAD_DIM];
        const int64_t inner = s[L_INNER];
        if (hidden != spec[L_HIDDEN] || hidden % 8 || inner % 8 || dim % 16 || kvh < 1 || qh % kvh) return -2;
        const int64_t elems = 2 * hidden + (qh + 2 * kvh) * dim + qh * dim + 3 * inner;
        int64_t wide = (qh + 2 * kvh) * dim;  /* an int8 linear's float32 outputs, the widest */
        if (2 * inner > wide) wide = 2 * inner;
        if (hidden > wide) wide = hidden;
        const int64_t floats = 2 * qh * dim + wide;
        if (elems > most_elems) most_elems = elems;
        if (floats > most_floats) most_floats = floats;
    }
    const int64_t bytes = rows * (most_elems * size + most_floats * 4) + 64;
    uint8_t *held = bytes <= LAYER_KEEP ? thread_kept(KEPT_LAYER, bytes) : NULL;
    uint8_t *mem = held ? held : malloc((size_t)bytes);
    if (!mem) return -1;
    const int64_t hidden = spec[L_HIDDEN];
    int status = 0;
    for (int64_t l = 0; l < layers && !status; l++) {
        const int64_t *s = spec + l * LAYER_FIELDS;
        const int64_t qh = s[L_Q_HEADS], kvh = s[L_KV_HEADS], dim = s[L_HEAD_DIM], inner = s[L_INNER];
        const int64_t qkv_out = (qh + 2 * kvh) * dim, q_out = qh * dim, kv_out = kvh * dim;
        float eps, scale;
        const int32_t eps_bits = (int32_t)s[L_EPS], scale_bits = (int32_t)s[L_SCALE];
        memcpy(&eps, &eps_bits, sizeof eps);
        memcpy(&scale, &scale_bits, sizeof scale);
        uint8_t *x = mem, *y = x + rows * hidden * size, *qkv = y + rows * hidden * size;
        uint8_t *o = qkv + rows * qkv_out * size, *gu = o + rows * q_out * size, *act = gu + rows * 2 * inner * size;
        float *qf = (float *)(act + rows * inner * size), *of = qf + rows * q_out, *wide = of + rows * q_out;
#define LINEAR(field, in, out) \
        linear((const int64_t *)s[field], (const int64_t *)s[field + 1], in, rows, out, wide, bf16, threads)
        kvc_rms_norm(h, bf16, (const float *)s[L_IN_NORM], rows, hidden, eps, 0, x, threads);
        if ((status = LINEAR(L_QKV, x, qkv))) break;
        /* Qwen3's per-head norms, RoPE on the query and key heads, K and V stored, the queries in
         * float32 for attention */
        for (int64_t t = 0; t < rows; t++) {
            uint8_t *row = qkv + t * qkv_out * size;
            if (s[L_Q_NORM]) {
                float qk_eps;
                const int32_t qk_eps_bits = (int32_t)s[L_QK_EPS];
                memcpy(&qk_eps, &qk_eps_bits, sizeof qk_eps);
                kvc_rms_norm(row, bf16, (const float *)s[L_Q_NORM], qh, dim, qk_eps, 0, row, 1);
                kvc_rms_norm(row + q_out * size, bf16, (const float *)s[L_K_NORM], kvh, dim, qk_eps, 0,
                             row + q_out * size, 1);
            }
            for (int64_t head = 0; head < qh + kvh; head++)
                rope_head(row + head * dim * size, (const uint8_t *)cos + t * dim * size,
                          (const uint8_t *)sin + t * dim * size, dim, bf16);
            for (int64_t i = 0; i < q_out; i += 8) _mm256_storeu_ps(qf + t * q_out + i, load8(row, i, bf16));
            if (bits >= 16) {
                uint8_t *slot = pool + slot_blocks[t] * block_bytes + slot_offsets[t] * kv_out * size;
                memcpy(slot + s[L_K_REGION], row + q_out * size, (size_t)(kv_out * size));
                memcpy(slot + s[L_V_REGION], row + (q_out + kv_out) * size, (size_t)(kv_out * size));
            } else {
                for (int kv = 0; kv < 2; kv++)
                    if ((status = kvc_write_kv(pool, n_blocks, block_size, block_bytes, s[kv ? L_V_REGION : L_K_REGION],
                                               s[L_VALUES_BYTES], slot_blocks + t, slot_offsets + t, 1, kvh, dim,
                                               group, bits, row + (q_out + kv * kv_out) * size, bf16, 1)))
                        break;
                if (status) break;
            }
        }
        if (status) { status = -2; break; }
        if ((status = kvc_attend_kv(pool, n_blocks, block_bytes, s[L_K_REGION], s[L_V_REGION], s[L_VALUES_BYTES],
                                    tables, table_width, contexts, seq_rows, n_seq, block_size, kvh, dim, group,
                                    bits, qf, qh / kvh, scale, NULL, s[L_WINDOW], of, attend_threads)))
            break;
        const dest od = {o, bf16};
        for (int64_t i = 0; i < rows * q_out; i += 8) put8(od, i, _mm256_loadu_ps(of + i));
        if ((status = LINEAR(L_O, o, y))) break;
        for (int64_t t = 0; t < rows; t++)
            add_row((uint8_t *)h + t * hidden * size, y + t * hidden * size, hidden, bf16);
        kvc_rms_norm(h, bf16, (const float *)s[L_POST_NORM], rows, hidden, eps, 0, x, threads);
        if ((status = LINEAR(L_GATE_UP, x, gu))) break;
        for (int64_t t = 0; t < rows; t++) {
            const uint8_t *g = gu + t * 2 * inner * size;
            silu_row(g, g + inner * size, inner, bf16, act + t * inner * size);
        }
        if ((status = LINEAR(L_DOWN, act, y))) break;
        for (int64_t t = 0; t < rows; t++)
            add_row((uint8_t *)h + t * hidden * size, y + t * hidden * size, hidden, bf16);
#undef LINEAR
    }
    if (!held) free(mem);
    return status;
}
