/* kvcellar's CPU kernels (x86-64 with AVX2, FMA and F16C): what every family shares, and the
 * functions the library exports (native/library.py binds each by name). Built as one shared
 * library from the .c files beside this header:
 *   quantize.c  activations to 8 bits per block of 32 (the input of every linear kernel)
 *   int4.c      int4 linears: the row kernel, 8- and 16-row panels, weights kept as panels,
 *               routed experts, dequantization
 *   int8.c      int8 linears (the row layout and panels of 16 rows) and routed experts
 *   mxfp4.c     MXFP4 linears and routed experts, dequantization
 *   moe.c       a MoE block's routed experts, input to output (any of the three kinds above)
 *   linear.c    a quantized linear's step in one call, its activations quantized in it
 *   norm.c      RMSNorm of the hidden states
 *   layer.c     a dense decoder's layers in one call (a step's norms, linears, RoPE, attention, MLP)
 *   kv.c        KV blocks: gathered, written (quantized) and attended where they lie
 *   recurrent.c hybrid models' linear attention: the gated delta rule and the elementwise work
 *               around it
 *   router.c    mixture-of-experts routers: logits, the experts taken and their weights
 *   crc32.c     the block files' checksum
 *   amx.c       int4 panels on AMX tiles (prefill-sized steps, where the CPU has them)
 *   pool.c      the threads the kernels' loops run on
 *   logits.c    a step's logits: rounded to the model's bf16, their greatest per row
 *
 * Activations are quantized to 8 bits per block of 32 inputs (d = max|x| / 127, q = round(x / d))
 * and multiplied with the weights' integers in 8-bit dot products, the scheme of llama.cpp's
 * Q4_1 x Q8_1: a step reads the 4-bit weights once at close to memory speed, where torch's int4
 * kernel converts every weight to float first.
 *
 * Weight layouts are kvcellar.quantization's:
 *   int4: nibbles uint8 [out, in / 2] (input 2j in the low nibble of byte j), per group of 32
 *         inputs a scale and an offset (float16 here): w = q * scale + offset, q in 0..15;
 *   int8: int8 [out, in], a float32 scale per output: w = q * scale;
 *   mxfp4: nibbles as int4's, each an E2M1 code, an E8M0 exponent byte per group of 32.
 * Inside a block of 32 the quantized activations hold the even inputs first, then the odd
 * ones, the order in which a block's 16 bytes of nibbles unpack. */
#ifndef KVC_H
#define KVC_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
/* Rows of activations multiplied per pass over a weight row: enough accumulators to reuse
 * each loaded weight block, few enough to stay in the 16 vector registers. */
#define TILE 4
/* Bytes of weights ahead that a pass asks the cache for: the hardware prefetcher alone kept
 * a thread's stream well below the memory's speed; 4096 rather than 2048 is 4-5 % faster from
 * RAM for the int8, int4 and MXFP4 row kernels on a Zen 5 (docs/performance.md). */
#define PREFETCH 4096
/* Groups of 8 weight rows a thread takes at a time from a linear's shared work list: threads
 * take work as they come, so one that wakes late (the passive OpenMP wait policy, a busy
 * vCPU) does not hold the others at the end of the call, as fixed shares did; 16 groups (a
 * row of 4096 int4 inputs: 256 KB) keep the taking cheap. Each output is computed the same
 * whichever thread takes it. */
#define ROW_GROUPS 16

/* Kernels for CPUs with AVX-512 (F, BW, VL and the 8-bit dot product, VNNI) are built by target
 * attributes and called where avx512_cpu() holds; each gives the same bits as its AVX2 form.
 * KVCELLAR_AVX512=0 runs the AVX2 forms (a comparison, or a CPU that misreports). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

static inline int avx512_cpu(void) {
    static int has = -1;
    if (has < 0) {
        const char *off = getenv("KVCELLAR_AVX512");
        has = !(off && strcmp(off, "0") == 0) && __builtin_cpu_supports("avx512f")
              && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
              && __builtin_cpu_supports("avx512vnni");
    }
    return has;
}

/* The last 1-3 (1-7) activation rows of a kernel that takes 4 (8) at a time: ROWS(n) with each
 * count n a constant, so that its accumulators stay in registers. */
#define LAST_ROWS_OF_4(left, ROWS) do {                                                              \
        switch (left) {                                                                              \
            case 3: ROWS(3); break;                                                                  \
            case 2: ROWS(2); break;                                                                  \
            case 1: ROWS(1); break;                                                                  \
            default: break;                                                                          \
        }                                                                                            \
    } while (0)

#define LAST_ROWS_OF_8(left, ROWS) do {                                                              \
        switch (left) {                                                                              \
            case 7: ROWS(7); break;                                                                  \
            case 6: ROWS(6); break;                                                                  \
            case 5: ROWS(5); break;                                                                  \
            case 4: ROWS(4); break;                                                                  \
            default: LAST_ROWS_OF_4(left, ROWS); break;                                              \
        }                                                                                            \
    } while (0)

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block of 32 activations to 8 bits (kvc_quantize_q8's arithmetic): q (the even inputs
 * first), its scale d = max|v| / 127 and d x the sum of q (what an offset multiplies). */
static inline void quantize_block(const float *v, int8_t *q, float *d_out, float *s_out) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int k = 0; k < BLOCK; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    /* round(v x id) to nearest even (|q| <= 127: the packs below saturate nothing), the even
     * inputs to q[0..15] and the odd ones to q[16..31]: each 8 lanes' evens to its lower half,
     * then two packs per 128-bit half put evens 0-15 in bytes 0-15 and odds in 16-31 */
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i halves = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256i x[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), vid));
        total = _mm256_add_epi32(total, r);
        x[j] = _mm256_permutevar8x32_epi32(r, halves);
    }
    _mm256_storeu_si256((__m256i *)q, _mm256_packs_epi16(_mm256_packs_epi32(x[0], x[1]),
                                                         _mm256_packs_epi32(x[2], x[3])));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    *d_out = d;
    *s_out = d * (float)_mm_cvtsi128_si32(t);
}

/* exp's polynomial in x - n ln 2 (Cephes'), highest power first, and its range and reduction
 * (ln 2 in two parts): exp8 and exp16, which must give the same bits. */
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};
#define EXP_LO (-87.0f)
#define EXP_HI 88.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)

/* exp of 8 floats: Cephes' polynomial on x - n ln 2, scaled by 2^n (relative error ~2e-7).
 * Arguments below -87 give 0, as exp's float does near there. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(EXP_LO);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[k]));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* exp8 on 16 lanes: each lane by exp8's operations, the same bits. */
static inline AVX512 __attribute__((always_inline)) __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(EXP_LO);
    const __mmask16 kept = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);  /* exp8's not (x < lo): NaN kept */
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < 6; k++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[k]));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(kept, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

/* A block's 16 bytes of nibbles as 32 bytes: low nibbles (even inputs) in the lower half,
 * high nibbles in the upper. */
static inline __m256 q4_block(const uint8_t *wb) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)wb));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                                _mm256_set1_epi8(0x0F)));
}

/* 8 bfloat16 values at src as floats (a bf16 is the upper half of a float32: exact). */
static inline __m256 load8_bf16(const uint16_t *src) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}

/* load8_bf16 on 16 lanes (AVX-512). */
static inline AVX512 __attribute__((always_inline)) __m512 load16_bf16(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

/* v rounded to bfloat16 (nearest even) and kept as a float. */
static inline __m256 round_bf16(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 floats as bfloat16 bits, rounded to nearest even as torch rounds them (NaN: 0x7FC0). */
static inline __m128i bf16_bits8(__m256 v) {
    __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* packus works per 128-bit lane (r0-3 r0-3 | r4-7 r4-7): quadwords 0 and 2 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* Where a kernel writes its outputs: float32, or bfloat16 (bf16_bits8) for a bf16 model, which
 * then runs no conversion pass over them. */
typedef struct { void *base; int bf16; } dest;

static inline dest dest_at(dest d, int64_t at) {
    d.base = d.bf16 ? (void *)((uint16_t *)d.base + at) : (void *)((float *)d.base + at);
    return d;
}

/* Outputs at..at+7 of d. */
static inline void put8(dest d, int64_t at, __m256 v) {
    if (d.bf16) _mm_storeu_si128((__m128i *)((uint16_t *)d.base + at), bf16_bits8(v));
    else _mm256_storeu_ps((float *)d.base + at, v);
}

/* Outputs at..at+15 of d from one 512-bit vector (AVX-512 kernels). */
static inline AVX512 __attribute__((always_inline)) void put16_wide(dest d, int64_t at, __m512 v) {
    if (d.bf16) {
        put8(d, at, _mm512_castps512_ps256(v));
        put8(d, at + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    } else {
        _mm512_storeu_ps((float *)d.base + at, v);
    }
}

/* 16 values stored: as float32, or (already bf16 values) as their upper halves. */
static inline __attribute__((always_inline)) void put16(__m256 a, __m256 b, void *out, int64_t at, const int BF16) {
    if (BF16) {
        const __m256i ha = _mm256_srli_epi32(_mm256_castps_si256(a), 16), hb = _mm256_srli_epi32(_mm256_castps_si256(b), 16);
        /* packus works per 128-bit lane: a0-3 b0-3 | a4-7 b4-7, put back in order */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(ha, hb), 0xD8);
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), packed);
    } else {
        _mm256_storeu_ps((float *)out + at, a);
        _mm256_storeu_ps((float *)out + at + 8, b);
    }
}

/* 8 rows of 8 floats transposed in place: r[k] lane j <- r[j] lane k. */
static inline void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* Outputs r0..r0+7 (those below out) of n activation rows from their accumulators (lane j:
 * output r0 + j), into y [n, out]. */
static inline void store8(const __m256 *acc, int n, int64_t r0, int64_t out, float *y) {
    const int m = out - r0 < 8 ? (int)(out - r0) : 8;
    for (int a = 0; a < n; a++) {
        if (m == 8) {
            _mm256_storeu_ps(y + a * out + r0, acc[a]);
        } else {
            float part[8];
            _mm256_storeu_ps(part, acc[a]);
            memcpy(y + a * out + r0, part, m * sizeof(float));
        }
    }
}

/* Output rows of 4-bit weights taken 8 at a time by the prefill kernels (a "panel"). */
#define PANEL 8

/* Block b of rows r0..r0+7 of 4-bit weights (nibbles [out, blocks x 16 bytes]) as a panel's
 * 128 bytes: chunk c (bytes 4c..4c+3 of each row's 16) of rows 0..7, 32 bytes, so that one load
 * holds 4 inputs (low nibbles) and 4 more (high nibbles) of every row; in each 32 bytes rows
 * 0-3 fill the lower 16, rows 4-7 the upper. */
static inline void panel_nibbles(const uint8_t *w, int64_t blocks, int64_t r0, int64_t b, uint8_t *dst) {
    const int64_t stride = blocks * (BLOCK / 2);
    __m128i row[PANEL];
    for (int j = 0; j < PANEL; j++) row[j] = _mm_loadu_si128((const __m128i *)(w + (r0 + j) * stride + b * (BLOCK / 2)));
    /* a 4x4 transpose of dwords for rows 0-3 and for rows 4-7 */
    for (int half = 0; half < 2; half++) {
        const __m128i *r = row + 4 * half;
        const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpacklo_epi32(r[2], r[3]);
        const __m128i t2 = _mm_unpackhi_epi32(r[0], r[1]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
        uint8_t *d = dst + half * 16;
        _mm_storeu_si128((__m128i *)(d + 0), _mm_unpacklo_epi64(t0, t1));
        _mm_storeu_si128((__m128i *)(d + 32), _mm_unpackhi_epi64(t0, t1));
        _mm_storeu_si128((__m128i *)(d + 64), _mm_unpacklo_epi64(t2, t3));
        _mm_storeu_si128((__m128i *)(d + 96), _mm_unpackhi_epi64(t2, t3));
    }
}

/* Groups of 8 rows (panels) a unit of int4 or MXFP4 weights kept as panels takes: 2 where the
 * CPU multiplies two panels at once (AVX-512's 8-bit dot product), else 1 (int4.c). */
int q4_panel_step(void);

/* Where panel p (of `panels`) of a weight kept as panels lies, in blocks' rows from the weight's
 * start (x 16 bytes: its nibbles; x 1: its per-block scale), and its blocks' step (*step): pairs
 * of panels interleaved block by block where two are multiplied at once (an odd last panel lies
 * alone), else each panel's blocks in a row. int4 and MXFP4 weights share the layout. */
static inline int64_t kept_panel_offset(int64_t p, int64_t panels, int64_t blocks, int *step) {
    const int paired = q4_panel_step() == 2 && (p | 1) < panels;
    *step = paired ? 2 : 1;
    return paired ? (p & ~(int64_t)1) * blocks * PANEL + (p & 1) * PANEL : p * blocks * PANEL;
}

/* Whether the unit of a weight kept as panels that starts at panel p (of `panels`) is a pair. */
static inline int unit_is_pair(int64_t p, int64_t panels) {
    return q4_panel_step() == 2 && p + 1 < panels;
}

/* panel_nibbles undone for a kept panel (its blocks at `step` blocks' room, from kw): the row
 * layout of its rows r0..r0+7 into w. */
static inline void unpack_panel_nibbles(const uint8_t *kw, int step, int64_t r0, int64_t blocks, uint8_t *w) {
    const int64_t stride = blocks * (BLOCK / 2);
    for (int64_t b = 0; b < blocks; b++)
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < PANEL; j++)
                memcpy(w + (r0 + j) * stride + b * (BLOCK / 2) + 4 * c,
                       kw + b * step * (PANEL * BLOCK / 2) + c * 32 + j * 4, 4);
}

/* ---- Routed experts: all of a MoE layer's experts in one call ----------------------------
 * A step's (token, expert) slots arrive grouped by expert: activation rows starts[e] ..
 * starts[e + 1] - 1 go through expert e's weights (w[e], scales[e], offsets[e]: addresses of
 * its linear, laid out as kvc_gemm_q4's or kvc_gemm_q8's), into the same rows of y [slots, out].
 * One parallel region runs every routed expert's output rows, where one call per expert woke
 * the threads 2 x top-k times a layer for a few hundred microseconds of work each. Each output
 * is computed by the arithmetic of kvc_gemm_q4 / kvc_gemm_q8, so a slot's numbers are the same
 * to the bit as its expert's linear run alone, at any row count. */

/* A unit of work: expert e's output rows g * 8 .. g * 8 + 7 for all its slots. */
typedef struct { int64_t e, g; } moe_unit;

/* Units of `step` groups of 8 rows (g the first; the last may hold fewer), groups per expert. */
static inline moe_unit *moe_units(const int64_t *starts, int64_t experts, int64_t groups, int64_t step,
                                  int64_t *count) {
    const int64_t per = (groups + step - 1) / step;
    int64_t n = 0;
    for (int64_t e = 0; e < experts; e++) n += starts[e + 1] > starts[e] ? per : 0;
    moe_unit *units = malloc((size_t)(n > 0 ? n : 1) * sizeof(moe_unit));
    if (!units) return NULL;
    int64_t i = 0;
    for (int64_t e = 0; e < experts; e++)
        if (starts[e + 1] > starts[e])
            for (int64_t g = 0; g < groups; g += step) units[i++] = (moe_unit){e, g};
    *count = n;
    return units;
}

/* The work list of linears 0..count-1 of outs[i] rows: (i, g) for each `step` groups of 8 rows
 * from group g on. */
static inline moe_unit *linear_units(const int64_t *outs, int64_t count, int64_t step, int64_t *n) {
    *n = 0;
    for (int64_t i = 0; i < count; i++) *n += ((outs[i] + 7) / 8 + step - 1) / step;
    moe_unit *units = malloc((size_t)(*n > 0 ? *n : 1) * sizeof(moe_unit));
    if (units)
        for (int64_t i = 0, u = 0; i < count; i++)
            for (int64_t g = 0; g < (outs[i] + 7) / 8; g += step) units[u++] = (moe_unit){i, g};
    return units;
}

/* A step's logits (logits.c). */
void kvc_round_bf16(float *x, int64_t n);
void kvc_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out);
int kvc_topk_row(const float *x, int64_t n, int64_t k, float *values, int64_t *ids);

/* AMX tiles (amx.c). A call's activation rows packed for them (amx_pack: whole tiles of 16 rows
 * from its first row; tiles 0 where they do not run: another CPU, fewer rows), and up to
 * AMX_GROUP pairs of int4 panels kept interleaved (each: the pair's weights, scales and offsets,
 * and y, its first output of the first activation row) multiplied on them, each tile of
 * activations against every pair while it is in the cache: returns the rows done (the tiles'
 * rows; 0 where none ran). */
#define AMX_GROUP 4
typedef struct { const int8_t *q; const float *d, *s; int64_t tiles; } amx_acts;
typedef struct { const uint8_t *w; const uint16_t *s, *o; dest y; int64_t out; } amx_pair;
int amx_cpu(void);
int amx_pack(const int8_t *xq, const float *xd, const float *xs, int64_t rows, int64_t cols, amx_acts *acts,
             int threads);
int64_t q4_pairs_amx(const amx_pair *pairs, int n, int64_t blocks, const amx_acts *acts);

/* Units handed out at a time: where the step gives its experts few rows each (decode), a unit
 * is a few microseconds of reading, and one at a time the threads take turns on alternate
 * units (no streaming read for the prefetchers, a shared counter each microsecond): 2 threads
 * were slower than 1 (docs/performance.md); with many rows, one at a time keeps them even. */
static inline int moe_chunk(const int64_t *starts, int64_t experts) {
    int64_t active = 0;
    for (int64_t e = 0; e < experts; e++) active += starts[e + 1] > starts[e];
    return starts[experts] < 8 * active ? ROW_GROUPS : 1;
}

/* One projection of a layer's experts: per expert the addresses of its weight, its scales
 * (MXFP4: exponents) and (int4) offsets; int4 kept as panels or not. */
typedef struct { const int64_t *w, *s, *o; int panels; } moe_proj;

/* A family's routed-experts work: units u0..u1-1 of projection p, slots grouped by starts, into
 * y [slots, out]; *scratch: the calling thread's scratch for this loop, allocated by the family
 * where it needs one (NULL at first; freed by the loop's caller). */
typedef void (*moe_project)(const moe_proj *p, const moe_unit *units, int64_t u0, int64_t u1,
                            const int64_t *starts, int64_t out, int64_t cols, const int8_t *xq, const float *xd,
                            const float *xs, float *y, void **scratch);
void moe_q4_project(const moe_proj *p, const moe_unit *units, int64_t u0, int64_t u1, const int64_t *starts,
                    int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y,
                    void **scratch);
void moe_q8_project(const moe_proj *p, const moe_unit *units, int64_t u0, int64_t u1, const int64_t *starts,
                    int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y,
                    void **scratch);
void moe_mx_project(const moe_proj *p, const moe_unit *units, int64_t u0, int64_t u1, const int64_t *starts,
                    int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y,
                    void **scratch);
/* One projection of the routed experts in one loop (moe.c): 0, or -1 (no memory). */
int moe_matmul(moe_project project, const moe_proj *p, const int64_t *starts, int64_t experts, int64_t out,
               int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y, int threads);

/* The kernels' threads (pool.c): items 0..n-1 of a loop, `chunk` at a time, to the calling
 * thread (thread 0) and up to threads - 1 workers (1..threads-1: an index for per-thread
 * scratch), each range [begin, end) given to body once; returns when all are done. */
typedef void (*pool_body)(void *ctx, int64_t begin, int64_t end, int thread);
void pool_for(int threads, int64_t n, int64_t chunk, pool_body body, void *ctx);
/* Threads a loop runs on at most: a body's thread index is below this and below `threads`, so
 * a loop's per-thread scratch fits an array of this many pointers (NULL until a thread's first
 * need; free_scratch after the loop). */
#define POOL_THREADS 256

static inline void free_scratch(void **scratch, int threads) {
    for (int t = 0; t < threads && t < POOL_THREADS; t++) free(scratch[t]);
}

/* Memory a thread keeps in `slot` for its next call, at least `bytes` (64-byte aligned; NULL
 * where there was none); freed when the thread ends (pool.c). */
enum { KEPT_B_TILES, KEPT_AMX_ACTS, KEPT_LINEAR_ACTS, KEPT_ATTEND, KEPT_LAYER, KEPT_SLOTS };

/* kvc_linear's kinds of weight (spec[0]): int4 kept as panels, int8, int8 kept as panels. */
enum { LINEAR_Q4P = 0, LINEAR_Q8 = 1, LINEAR_Q8P = 2 };

/* kvc_dense_layers' spec, per layer: sizes, the norms' float32 weights and eps, each linear's
 * kvc_linear spec and its parts' biases (an array of addresses, 0: none), K's and V's bytes into a block, a quantized block's values
 * bytes, attention's scale and window, Qwen3's per-head norms of queries and keys (float32
 * weights, 0: none) and their eps (eps and scale as float bits). */
enum {
    L_HIDDEN, L_Q_HEADS, L_KV_HEADS, L_HEAD_DIM, L_INNER, L_IN_NORM, L_POST_NORM, L_EPS, L_QKV, L_QKV_BIAS, L_O,
    L_O_BIAS, L_GATE_UP, L_GATE_UP_BIAS, L_DOWN, L_DOWN_BIAS, L_K_REGION, L_V_REGION, L_VALUES_BYTES, L_SCALE,
    L_WINDOW, L_Q_NORM, L_K_NORM, L_QK_EPS, LAYER_FIELDS
};
void *thread_kept(int slot, int64_t bytes);

/* The exported kernels. Those returning int give 0, or -1 where they had no memory for their
 * scratch (nothing written), or -2 for an argument outside its bounds (nothing written). */
void kvc_quantize_q8(const void *x, int x_bf16, int64_t rows, int64_t cols, int8_t *xq, float *xd, float *xs, int threads);
void kvc_gemm_q4(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y, int threads);
void kvc_gemm_q4_panels(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y, int threads);
void kvc_gemm_q4_panels16(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y, int threads);
void kvc_gemm_q8(const int8_t *w, const float *scales, int64_t out, int64_t cols, const int8_t *xq, const float *xd, int64_t rows, float *y, int threads);
void kvc_gemm_mxfp4(const uint8_t *w, const uint8_t *exps, int64_t out, int64_t cols, const int8_t *xq, const float *xd, int64_t rows, float *y, int threads);
void kvc_pack_mxfp4(const uint8_t *w, const uint8_t *exps, int64_t out, int64_t cols, uint8_t *pw, uint8_t *pe, int threads);
void kvc_unpack_mxfp4(const uint8_t *pw, const uint8_t *pe, int64_t out, int64_t cols, uint8_t *w, uint8_t *exps, int threads);
void kvc_gemm_mxfp4p(const uint8_t *pw, const uint8_t *pe, int64_t out, int64_t cols, const int8_t *xq, const float *xd, int64_t rows, float *y, int threads);
int kvc_moe_mxfp4p(const int64_t *w, const int64_t *exps, const int64_t *starts, int64_t experts, int64_t out, int64_t cols, const int8_t *xq, const float *xd, float *y, int threads);
void kvc_dequantize_mxfp4(const uint8_t *w, const uint8_t *exps, int64_t start, int64_t end, int64_t cols, float *out, int threads);
int kvc_gemm_q4_many(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *outs, const int64_t *ys, int64_t count, int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, int threads);
int kvc_moe_q4(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *starts, int64_t experts, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y, int threads);
int kvc_gemm_q8_many(const int64_t *w, const int64_t *scales, const int64_t *outs, const int64_t *ys, int64_t count, int64_t cols, const int8_t *xq, const float *xd, int64_t rows, int threads);
int kvc_pack_q8(const int8_t *w, int64_t out, int64_t cols, uint8_t *pw, int threads);
int kvc_gemm_q8p(const uint8_t *pw, const float *scales, int64_t out, int64_t cols, const int8_t *xq, const float *xd, int64_t rows, float *y, int threads);
int kvc_gemm_q8p_many(const int64_t *w, const int64_t *scales, const int64_t *outs, const int64_t *ys, int64_t count, int64_t cols, const int8_t *xq, const float *xd, int64_t rows, int threads);
int kvc_moe_q8(const int64_t *w, const int64_t *scales, const int64_t *starts, int64_t experts, int64_t out, int64_t cols, const int8_t *xq, const float *xd, float *y, int threads);
int kvc_moe_mxfp4(const int64_t *w, const int64_t *exps, const int64_t *starts, int64_t experts, int64_t out, int64_t cols, const int8_t *xq, const float *xd, float *y, int threads);
void kvc_dequantize_q4(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t start, int64_t end, int64_t cols, void *dst, int bf16, int threads);
void kvc_pack_q4(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out, int64_t cols, uint8_t *pw, uint16_t *ps, uint16_t *po, int threads);
void kvc_unpack_q4(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t out, int64_t cols, uint8_t *w, uint16_t *scales, uint16_t *offsets, int threads);
void kvc_gemm_q4p(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, void *y, int y_bf16, int threads);
int kvc_gemm_q4p_many(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *outs, const int64_t *ys, int64_t count, int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, int y_bf16, int threads);
int kvc_moe_q4p(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *starts, int64_t experts, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y, int threads);
int kvc_moe_glu(int kind, const float *x, int64_t tokens, int64_t cols, const int64_t *index, const float *weights, int64_t k, int64_t experts, const int64_t *gw, const int64_t *gs, const int64_t *go, const float *gb, const int64_t *dw, const int64_t *ds, const int64_t *dof, const float *db, int64_t inner, int act, float alpha, float limit, float *y, int threads);
void kvc_gather_kv(const uint8_t *pool, int64_t block_bytes, int64_t region, int64_t values_bytes, const int64_t *blocks, int64_t n_blocks, int64_t rows, int64_t head_dim, int64_t group, int bits, void *out, int bf16, int threads);
int kvc_attend_kv(const uint8_t *pool, int64_t n_blocks, int64_t block_bytes, int64_t k_region, int64_t v_region, int64_t values_bytes, const int64_t *tables, int64_t table_width, const int64_t *contexts, const int64_t *rows, int64_t n_seq, int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t group, int bits, const float *q, int64_t gq, float scale, const float *sinks, int64_t window, float *out, int threads);
int kvc_write_kv(uint8_t *pool, int64_t n_blocks, int64_t block_size, int64_t block_bytes, int64_t region, int64_t values_bytes, const int64_t *blocks, const int64_t *offsets, int64_t n_rows, int64_t kv_heads, int64_t head_dim, int64_t group, int bits, const void *x, int x_bf16, int threads);
int kvc_route(const float *x, const float *weight, const float *bias, int64_t rows, int64_t cols, int64_t experts, int64_t k, int order, int normalize, float *logits, int64_t *index, float *weights, int threads);
void kvc_rms_norm(const void *x, int bf16, const float *weight, int64_t rows, int64_t cols, float eps, int weight_first, void *out, int threads);
int kvc_linear(const int64_t *spec, const void *x, int x_bf16, int64_t rows, const int64_t *ys, int y_bf16, int threads);
void kvc_silu(const void *x, int bf16, int64_t rows, int64_t cols, int64_t stride, void *out, int threads);
int kvc_layer_fields(void);
int kvc_dense_layers(const int64_t *spec, int64_t layers, void *h, int bf16, int64_t rows, const void *cos, const void *sin, uint8_t *pool, int64_t n_blocks, int64_t block_size, int64_t block_bytes, int64_t group, int bits, const int64_t *slot_blocks, const int64_t *slot_offsets, const int64_t *tables, int64_t table_width, const int64_t *contexts, const int64_t *seq_rows, int64_t n_seq, int attend_threads, int threads);
void kvc_pool_spin(int64_t microseconds);
int kvc_amx(void);
void kvc_pool_counts(int64_t *out);
uint32_t kvc_crc32(const uint8_t *buf, int64_t len, uint32_t crc);
int kvc_gated_delta(const float *q, const float *k, const float *v, const float *decay, const float *beta, float *states, int64_t n_slots, const int64_t *slots, const int64_t *captures, int64_t rows, int64_t heads, int64_t key_dim, int64_t value_dim, float *out, int threads);
int kvc_delta_inputs(const float *conv, const float *a, const float *b, const float *neg_a, const float *dt_bias, int64_t rows, int64_t key_heads, int64_t key_dim, int64_t value_heads, int64_t value_dim, float scale, float eps, float *q, float *k, float *v, float *decay, float *beta, int threads);
int kvc_gated_norm(const float *core, const float *z, const float *weight, int64_t rows, int64_t heads, int64_t dim, float eps, float *out, int threads);
int kvc_delta_conv(const float *x, float *states, int64_t n_slots, const int64_t *slots, const int64_t *captures, const float *weight, int64_t rows, int64_t channels, int64_t taps, float *out, int threads);

#endif
