/* The gated delta rule (Gated DeltaNet, engine/deltanet.py), a token at a time, each value head
 * on one thread with its state in cache for all of a step's rows:
 *
 *   S = S * decay;  delta = (v - S^T k) * beta;  S = S + k delta^T;  o = S^T q
 *
 * S [key_dim, value_dim] per head. Every sum runs over the key dimension in ascending order
 * with fused multiply-adds, eight value columns to a vector: a row's numbers depend only on its
 * own inputs and the state it continues, never on the other rows of the step. */
#include "kvc.h"

#define COLS 32 /* value columns a pass over the key dimension carries: four vectors */

/* One row of one head: S updated in place, o [value_dim] written. */
static void delta_row(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                      int64_t key_dim, int64_t value_dim, float *o) {
    const __m256 d = _mm256_set1_ps(decay);
    const __m256 b = _mm256_set1_ps(beta);
    for (int64_t c = 0; c < value_dim; c += COLS) {
        const int64_t width = value_dim - c < COLS ? value_dim - c : COLS; /* a multiple of 8 */
        const int64_t vecs = width / 8;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < key_dim; i++) {
            float *row = S + i * value_dim + c;
            const __m256 ki = _mm256_set1_ps(k[i]);
            for (int64_t u = 0; u < vecs; u++) {
                const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * u), d);
                _mm256_storeu_ps(row + 8 * u, s);
                acc[u] = _mm256_fmadd_ps(s, ki, acc[u]);
            }
        }
        __m256 delta[4];
        for (int64_t u = 0; u < vecs; u++) {
            delta[u] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + c + 8 * u), acc[u]), b);
            acc[u] = _mm256_setzero_ps();
        }
        for (int64_t i = 0; i < key_dim; i++) {
            float *row = S + i * value_dim + c;
            const __m256 ki = _mm256_set1_ps(k[i]);
            const __m256 qi = _mm256_set1_ps(q[i]);
            for (int64_t u = 0; u < vecs; u++) {
                const __m256 s = _mm256_fmadd_ps(ki, delta[u], _mm256_loadu_ps(row + 8 * u));
                _mm256_storeu_ps(row + 8 * u, s);
                acc[u] = _mm256_fmadd_ps(s, qi, acc[u]);
            }
        }
        for (int64_t u = 0; u < vecs; u++)
            _mm256_storeu_ps(o + c + 8 * u, acc[u]);
    }
}

typedef struct {
    const float *q, *k, *v, *decay, *beta; float *states; const int64_t *slots, *captures;
    int64_t rows, heads, key_dim, value_dim; float *out;
} delta_call;

/* Heads h0..h1-1 of every row, rows in order (a head's state is carried from row to row). */
static void delta_heads(void *ctx, int64_t h0, int64_t h1, int thread) {
    (void)thread;
    const delta_call *c = ctx;
    const int64_t heads = c->heads, key_dim = c->key_dim, value_dim = c->value_dim, size = key_dim * value_dim;
    for (int64_t h = h0; h < h1; h++)
        for (int64_t r = 0; r < c->rows; r++) {
            const int64_t at = r * heads + h;
            float *S = c->states + (c->slots[r] * heads + h) * size;
            delta_row(S, c->q + at * key_dim, c->k + at * key_dim, c->v + at * value_dim, c->decay[at], c->beta[at],
                      key_dim, value_dim, c->out + at * value_dim);
            if (c->captures[r] >= 0)
                memcpy(c->states + (c->captures[r] * heads + h) * size, S, (size_t)size * sizeof(float));
        }
}

int kvc_gated_delta(const float *q, const float *k, const float *v, const float *decay, const float *beta,
                    float *states, int64_t n_slots, const int64_t *slots, const int64_t *captures, int64_t rows,
                    int64_t heads, int64_t key_dim, int64_t value_dim, float *out, int threads) {
    if (value_dim % 8 != 0 || key_dim <= 0 || heads <= 0)
        return -1;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= n_slots || captures[r] < -1 || captures[r] >= n_slots)
            return -2;
    delta_call c = {q, k, v, decay, beta, states, slots, captures, rows, heads, key_dim, value_dim, out};
    pool_for(threads, heads, 1, delta_heads, &c);
    return 0;
}

/* ---- A Gated DeltaNet layer's elementwise work around the rule ---------------------------
 * Torch spent ~100 small ops a layer on it (SiLU, L2 norms, gates, the gated RMS norm): a
 * decode step of a 9B hybrid paid more for their dispatch than for their arithmetic. Each row
 * here is computed by the same code whatever the step (vector body, scalar tail at fixed
 * positions), so a row's numbers do not depend on the other rows. */

static inline __m256 silu8(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

/* out[0..n) = silu(x[0..n)); returns the sum of the squares of the outputs (fixed order). */
static float silu_sq(const float *x, int64_t n, float *out) {
    __m256 ss = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 s = silu8(_mm256_loadu_ps(x + i));
        _mm256_storeu_ps(out + i, s);
        ss = _mm256_fmadd_ps(s, s, ss);
    }
    float sum = hsum(ss);
    for (; i < n; i++) {
        out[i] = silu1(x[i]);
        sum += out[i] * out[i];
    }
    return sum;
}

static void scale_by(float *x, int64_t n, float a, float b) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(a)),
                                              _mm256_set1_ps(b)));
    for (; i < n; i++) x[i] = x[i] * a * b;
}

int kvc_delta_inputs(const float *conv, const float *a, const float *b, const float *neg_a, const float *dt_bias,
                     int64_t rows, int64_t key_heads, int64_t key_dim, int64_t value_heads, int64_t value_dim,
                     float scale, float eps, float *q, float *k, float *v, float *decay, float *beta, int threads) {
    if (rows < 0 || key_heads <= 0 || key_dim <= 0 || value_dim <= 0 || value_heads % key_heads != 0)
        return -2;
    const int64_t ks = key_heads * key_dim, channels = 2 * ks + value_heads * value_dim;
    const int64_t repeat = value_heads / key_heads;
#pragma omp parallel for num_threads(rows > 1 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = conv + r * channels;
        float *qr = q + r * value_heads * key_dim, *kr = k + r * value_heads * key_dim;
        for (int64_t h = 0; h < key_heads; h++) {
            /* key head h feeds value heads h * repeat ..: computed into the first, copied on */
            float *qh = qr + h * repeat * key_dim, *kh = kr + h * repeat * key_dim;
            const float sq = silu_sq(c + h * key_dim, key_dim, qh);
            scale_by(qh, key_dim, 1.0f / sqrtf(sq + eps), scale);
            const float sk = silu_sq(c + ks + h * key_dim, key_dim, kh);
            scale_by(kh, key_dim, 1.0f / sqrtf(sk + eps), 1.0f);
            for (int64_t j = 1; j < repeat; j++) {
                memcpy(qh + j * key_dim, qh, (size_t)key_dim * sizeof(float));
                memcpy(kh + j * key_dim, kh, (size_t)key_dim * sizeof(float));
            }
        }
        silu_sq(c + 2 * ks, value_heads * value_dim, v + r * value_heads * value_dim);
        for (int64_t h = 0; h < value_heads; h++) {
            const int64_t at = r * value_heads + h;
            const float x = a[at] + dt_bias[h];
            const float softplus = x > 20.0f ? x : log1pf(expf(x));  /* torch's threshold */
            decay[at] = expf(neg_a[h] * softplus);
            beta[at] = 1.0f / (1.0f + expf(-b[at]));
        }
    }
    return 0;
}

int kvc_gated_norm(const float *core, const float *z, const float *weight, int64_t rows, int64_t heads, int64_t dim,
                   float eps, float *out, int threads) {
    if (rows < 0 || heads <= 0 || dim <= 0)
        return -2;
#pragma omp parallel for num_threads(rows > 1 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = (r * heads + h) * dim;
            const float *x = core + at, *g = z + at;
            float *o = out + at;
            __m256 ss = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= dim; i += 8) {
                const __m256 xi = _mm256_loadu_ps(x + i);
                ss = _mm256_fmadd_ps(xi, xi, ss);
            }
            float sum = hsum(ss);
            for (; i < dim; i++) sum += x[i] * x[i];
            const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
            const __m256 vinv = _mm256_set1_ps(inv);
            for (i = 0; i + 8 <= dim; i += 8) {
                const __m256 n = _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(n, silu8(_mm256_loadu_ps(g + i))));
            }
            for (; i < dim; i++) o[i] = weight[i] * (x[i] * inv) * silu1(g[i]);
        }
    }
    return 0;
}

/* The causal convolution before the rule, with its state: each row's channels against the
 * kernel's taps over the inputs before it (the slot's last taps - 1 inputs, oldest first, then
 * the rows of the same slot before it), summed tap by tap in order, before the SiLU. Rows of
 * one slot come in order; runs of rows of one slot are taken together, 8 channels to a vector
 * with the window in registers; the state after row r is copied into slot captures[r] unless
 * it is -1. The weight is laid out tap by tap ([taps, channels]). */
#define MAX_TAPS 8

static void conv_run(const float *x, float *states, int64_t slot, const int64_t *captures, const float *weight,
                     int64_t r0, int64_t r1, int64_t channels, int64_t taps, int64_t c0, int64_t c1, float *out) {
    const int64_t keep = taps - 1;
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
        __m256 win[MAX_TAPS], w[MAX_TAPS];
        for (int64_t j = 0; j < taps; j++) w[j] = _mm256_loadu_ps(weight + j * channels + c);
        float *st = states + (slot * channels + c) * keep;
        for (int64_t j = 0; j < keep; j++) {
            float sj[8];
            for (int i = 0; i < 8; i++) sj[i] = st[i * keep + j];
            win[j] = _mm256_loadu_ps(sj);
        }
        for (int64_t r = r0; r < r1; r++) {
            win[keep] = _mm256_loadu_ps(x + r * channels + c);
            __m256 acc = _mm256_mul_ps(win[0], w[0]);
            for (int64_t j = 1; j < taps; j++) acc = _mm256_add_ps(acc, _mm256_mul_ps(win[j], w[j]));
            _mm256_storeu_ps(out + r * channels + c, acc);
            for (int64_t j = 0; j < keep; j++) win[j] = win[j + 1];
            if (captures[r] >= 0) {
                float *cap = states + (captures[r] * channels + c) * keep;
                for (int64_t j = 0; j < keep; j++) {
                    float sj[8];
                    _mm256_storeu_ps(sj, win[j]);
                    for (int i = 0; i < 8; i++) cap[i * keep + j] = sj[i];
                }
            }
        }
        for (int64_t j = 0; j < keep; j++) {
            float sj[8];
            _mm256_storeu_ps(sj, win[j]);
            for (int i = 0; i < 8; i++) st[i * keep + j] = sj[i];
        }
    }
    for (; c < c1; c++) {
        float win[MAX_TAPS], w[MAX_TAPS];
        for (int64_t j = 0; j < taps; j++) w[j] = weight[j * channels + c];
        float *st = states + (slot * channels + c) * keep;
        for (int64_t j = 0; j < keep; j++) win[j] = st[j];
        for (int64_t r = r0; r < r1; r++) {
            win[keep] = x[r * channels + c];
            float acc = win[0] * w[0];
            for (int64_t j = 1; j < taps; j++) acc = acc + win[j] * w[j];
            out[r * channels + c] = acc;
            for (int64_t j = 0; j < keep; j++) win[j] = win[j + 1];
            if (captures[r] >= 0)
                memcpy(states + (captures[r] * channels + c) * keep, win, (size_t)keep * sizeof(float));
        }
        memcpy(st, win, (size_t)keep * sizeof(float));
    }
}

/* Channels a thread takes at a time: a row's 64 floats of them stay in a cache line pair. */
#define CONV_CHANNELS 64
/* Rows x channels below which one thread does it all: waking the others costs more. */
#define CONV_SERIAL (1 << 16)

int kvc_delta_conv(const float *x, float *states, int64_t n_slots, const int64_t *slots, const int64_t *captures,
                   const float *weight, int64_t rows, int64_t channels, int64_t taps, float *out, int threads) {
    if (taps < 2 || taps > MAX_TAPS - 1 || channels <= 0 || rows < 0)
        return -2;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= n_slots || captures[r] < -1 || captures[r] >= n_slots)
            return -2;
    const int64_t chunks = (channels + CONV_CHANNELS - 1) / CONV_CHANNELS;
#pragma omp parallel for num_threads(rows * channels < CONV_SERIAL ? 1 : threads) schedule(dynamic, 4)
    for (int64_t u = 0; u < chunks; u++) {
        const int64_t c0 = u * CONV_CHANNELS, c1 = c0 + CONV_CHANNELS < channels ? c0 + CONV_CHANNELS : channels;
        for (int64_t r0 = 0; r0 < rows;) {
            int64_t r1 = r0 + 1;
            while (r1 < rows && slots[r1] == slots[r0]) r1++;
            conv_run(x, states, slots[r0], captures, weight, r0, r1, channels, taps, c0, c1, out);
            r0 = r1;
        }
    }
    return 0;
}
