/* int4 weights kept as pairs of panels, multiplied on AMX tiles (Intel Sapphire Rapids on):
 * one tile instruction takes the 8-bit products of a block for 16 activation rows and 16
 * output rows, where AVX-512's 8-bit dot product takes 64 instructions for them. The integer
 * dot product of each block is the same exact integer as pair_tile's, and each output's float
 * operations are pair_tile's in its order (per block fma(dot, scale x activation scale) then
 * fma(offset, activation sum)): its bits, so a row's outputs do not depend on whether its step
 * ran here. A call's activations are packed into tiles once (amx_pack), each pair's weights
 * unpacked into B tiles once, and a thread runs each tile of activations against up to
 * AMX_GROUP pairs while it is in the cache. Taken where the CPU lists AMX-INT8, the OS gives the
 * process the tile state and KVCELLAR_AMX is not 0; rows past the last whole tile of 16, and
 * smaller steps, keep pair_tile. */
#include "kvc.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Compilers before GCC 11 and clang 12 have no AMX intrinsics: the library then builds without the
 * tiles (amx_cpu() 0), rather than not at all. */
#ifndef KVC_AMX_BUILT
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define KVC_AMX_BUILT 1
#else
#define KVC_AMX_BUILT 0
#endif
#endif

#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
/* Activation rows of a tile (its most), and bytes of a block's weights as a B tile (8 rows of
 * 16 outputs x 4 inputs). */
#define AMX_ROWS 16
#define B_BYTES 512
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_cpu(void) {
    static int has = -1;
    if (has < 0) {
        unsigned a, b, c, d;
        const char *off = getenv("KVCELLAR_AMX");
        int ok = KVC_AMX_BUILT && avx512_cpu() && !(off && strcmp(off, "0") == 0)
                 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);  /* AMX-TILE, -INT8 */
        /* Linux hands the tile state only to a process that asks for it; a VM's CPUID may list
         * AMX that its kernel does not enable (the request then fails) */
        if (ok && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) ok = 0;
        has = ok;
    }
    return has;
}

int kvc_amx(void) { return amx_cpu(); }

#if KVC_AMX_BUILT
/* Palette 1: tiles 0-1 dot products (16 rows x 16 int32), 2-3 activations (16 rows x one
 * block's 32 bytes), 4-5 weights (8 rows x 64 bytes). Static: the compiler keeps every byte of
 * it (a configuration built on the stack had its stores dropped before ldtilecfg at -O2). */
static const uint8_t tile_config[64] __attribute__((aligned(64))) = {
    [0] = 1,
    [16] = 64, [18] = 64, [20] = 32, [22] = 32, [24] = 64, [26] = 64,
    [48] = 16, [49] = 16, [50] = 16, [51] = 16, [52] = 8, [53] = 8,
};
#endif

#if KVC_AMX_BUILT
/* The pair's blocks as B tiles: block b's rows 0-3 the low nibbles of chunks 0-3 of both
 * panels (lanes 0-7 the first panel's rows, 8-15 the second's, pair_tile's), rows 4-7 the high
 * nibbles: row k holds, for each output, the weights of inputs 4k..4k+3 of the activations'
 * reordered block, as the tile instruction pairs them with a row's bytes 4k..4k+3. */
static AMX void unpack_pair(const uint8_t *pw, int64_t blocks, uint8_t *bt) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *w = pw + b * (2 * PANEL * BLOCK / 2);
        uint8_t *dst = bt + b * B_BYTES;
        for (int c = 0; c < 4; c++) {
            const __m256i first = _mm256_load_si256((const __m256i *)(w + 32 * c));
            const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(first),
                                                   _mm256_load_si256((const __m256i *)(w + PANEL * BLOCK / 2 + 32 * c)), 1);
            _mm512_store_si512(dst + 64 * c, _mm512_and_si512(raw, low));
            _mm512_store_si512(dst + 256 + 64 * c, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
        }
    }
}

#endif

/* Activations packed for the tiles, once a call (amx_pack): tile t's block b is 16 rows x 32
 * bytes, contiguous (16 rows a row apart cost 8 cache lines more a load), and its rows' scales
 * and sums 16 floats each (one address a block for the float pass, not 16). */
typedef struct { const int8_t *xq; const float *xd, *xs; int64_t cols; int8_t *q; float *d, *s; } pack_call;

static void pack_tiles(void *ctx, int64_t t0, int64_t t1, int thread) {
    (void)thread;
    const pack_call *c = ctx;
    const int64_t blocks = c->cols / BLOCK;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = t * blocks + b;
            for (int r = 0; r < AMX_ROWS; r++) {
                const int64_t row = t * AMX_ROWS + r;
                memcpy(c->q + at * AMX_ROWS * BLOCK + r * BLOCK, c->xq + row * c->cols + b * BLOCK, BLOCK);
                c->d[at * AMX_ROWS + r] = c->xd[row * blocks + b];
                c->s[at * AMX_ROWS + r] = c->xs[row * blocks + b];
            }
        }
}

int amx_pack(const int8_t *xq, const float *xd, const float *xs, int64_t rows, int64_t cols, amx_acts *acts,
             int threads) {
    acts->tiles = 0;
    if (rows < AMX_ROWS || !amx_cpu()) return 0;
    const int64_t tiles = rows / AMX_ROWS, blocks = cols / BLOCK;
    const int64_t qbytes = tiles * AMX_ROWS * cols, fbytes = tiles * blocks * AMX_ROWS * (int64_t)sizeof(float);
    uint8_t *base = thread_kept(KEPT_AMX_ACTS, qbytes + 2 * fbytes);
    if (!base) return -1;
    pack_call c = {xq, xd, xs, cols, (int8_t *)base, (float *)(base + qbytes), (float *)(base + qbytes + fbytes)};
    pool_for(threads, tiles, 1, pack_tiles, &c);
    *acts = (amx_acts){c.q, c.d, c.s, tiles};
    return 0;
}

#if KVC_AMX_BUILT
/* acc[a] += block b's scaled dot products (dots: 16 rows of 16 int32; d, s: the 16 rows' scales
 * and sums) for the tile's rows. */
static inline AMX __attribute__((always_inline)) void scale_block(const int32_t *dots, const uint16_t *ps,
                                                                   const uint16_t *po, int64_t b, const float *d,
                                                                   const float *s, __m512 *acc) {
    const uint16_t *sb = ps + b * 2 * PANEL, *ob = po ? po + b * 2 * PANEL : NULL;
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
    const __m512 wo = ob ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ob)) : _mm512_mul_ps(ws, _mm512_set1_ps(-8.0f));
    #pragma GCC unroll 16  /* acc stays in registers only if every index is a constant */
    for (int a = 0; a < AMX_ROWS; a++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(dots + 16 * a)));
        acc[a] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws, _mm512_set1_ps(d[a])), acc[a]);
        acc[a] = _mm512_fmadd_ps(wo, _mm512_set1_ps(s[a]), acc[a]);
    }
}

/* Tile t of the packed activations against the pair's B tiles into y (its first output of the
 * tile's first row); two blocks at a time on two sets of tiles. */
static AMX void tile_rows(const uint8_t *bt, const uint16_t *ps, const uint16_t *po, int64_t blocks,
                          const amx_acts *acts, int64_t t, dest y, int64_t out) {
    const int8_t *q = acts->q + t * blocks * AMX_ROWS * BLOCK;
    const float *d = acts->d + t * blocks * AMX_ROWS, *s = acts->s + t * blocks * AMX_ROWS;
    __m512 acc[AMX_ROWS];
    #pragma GCC unroll 16
    for (int a = 0; a < AMX_ROWS; a++) acc[a] = _mm512_setzero_ps();
    __attribute__((aligned(64))) int32_t dots[2][AMX_ROWS * 16];
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        _tile_loadd(2, q + b * AMX_ROWS * BLOCK, BLOCK);
        _tile_loadd(3, q + (b + 1) * AMX_ROWS * BLOCK, BLOCK);
        _tile_loadd(4, bt + b * B_BYTES, 64);
        _tile_loadd(5, bt + (b + 1) * B_BYTES, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 5);
        _tile_stored(0, dots[0], 64);
        _tile_stored(1, dots[1], 64);
        scale_block(dots[0], ps, po, b, d + b * AMX_ROWS, s + b * AMX_ROWS, acc);
        scale_block(dots[1], ps, po, b + 1, d + (b + 1) * AMX_ROWS, s + (b + 1) * AMX_ROWS, acc);
    }
    if (b < blocks) {
        _tile_loadd(2, q + b * AMX_ROWS * BLOCK, BLOCK);
        _tile_loadd(4, bt + b * B_BYTES, 64);
        _tile_zero(0);
        _tile_dpbsud(0, 2, 4);
        _tile_stored(0, dots[0], 64);
        scale_block(dots[0], ps, po, b, d + b * AMX_ROWS, s + b * AMX_ROWS, acc);
    }
    #pragma GCC unroll 16
    for (int a = 0; a < AMX_ROWS; a++) put16_wide(y, a * out, acc[a]);
}

static AMX int64_t pairs_on_tiles(const amx_pair *pairs, int n, int64_t blocks, const amx_acts *acts, uint8_t *bt) {
    for (int i = 0; i < n; i++) unpack_pair(pairs[i].w, blocks, bt + i * blocks * B_BYTES);
    _tile_loadconfig(tile_config);
    for (int64_t t = 0; t < acts->tiles; t++)
        for (int i = 0; i < n; i++)
            tile_rows(bt + i * blocks * B_BYTES, pairs[i].s, pairs[i].o, blocks, acts, t,
                      dest_at(pairs[i].y, t * AMX_ROWS * pairs[i].out), pairs[i].out);
    _tile_release();
    return acts->tiles * AMX_ROWS;
}

#endif

int64_t q4_pairs_amx(const amx_pair *pairs, int n, int64_t blocks, const amx_acts *acts) {
    if (n == 0 || acts->tiles == 0) return 0;  /* tiles 0 wherever amx_cpu() is 0 */
#if KVC_AMX_BUILT
    uint8_t *bt = thread_kept(KEPT_B_TILES, n * blocks * B_BYTES);
    return bt ? pairs_on_tiles(pairs, n, blocks, acts, bt) : 0;
#else
    (void)pairs;
    (void)blocks;
    return 0;
#endif
}
