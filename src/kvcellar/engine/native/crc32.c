#include "kvc.h"

/* CRC-32 as zlib computes it (reflected polynomial 0xEDB88320), folding 4 x 128 bits of the
 * buffer at a time with carry-less multiplication (Gopal et al., "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ Instruction", Intel, 2009; the constants are that
 * paper's x^n mod P for this polynomial, bit-reflected), then reduced to 32 bits (Barrett).
 * The block files' checksum: zlib 1.2's loop reads a byte at a time. */
#define CLMUL __attribute__((target("pclmul,sse4.1")))

static uint32_t crc32_bytes(uint32_t c, const uint8_t *p, int64_t n) {  /* c: the inverted state */
    while (n-- > 0) {
        c ^= *p++;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return c;
}

/* len >= 64, a multiple of 16; c and the result: the inverted state. */
static CLMUL uint32_t crc32_fold(const uint8_t *buf, int64_t len, uint32_t c) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
    const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124);
    const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i x[4];
    for (int i = 0; i < 4; i++) x[i] = _mm_loadu_si128((const __m128i *)(buf + 16 * i));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)c));
    buf += 64;
    len -= 64;
    for (; len >= 64; buf += 64, len -= 64)
        for (int i = 0; i < 4; i++) {
            const __m128i lo = _mm_clmulepi64_si128(x[i], k1k2, 0x00), hi = _mm_clmulepi64_si128(x[i], k1k2, 0x11);
            x[i] = _mm_xor_si128(_mm_xor_si128(lo, hi), _mm_loadu_si128((const __m128i *)(buf + 16 * i)));
        }
    __m128i r = x[0];
    for (int i = 1; i < 4; i++) {  /* the four lanes into one */
        const __m128i lo = _mm_clmulepi64_si128(r, k3k4, 0x00), hi = _mm_clmulepi64_si128(r, k3k4, 0x11);
        r = _mm_xor_si128(_mm_xor_si128(lo, hi), x[i]);
    }
    for (; len >= 16; buf += 16, len -= 16) {
        const __m128i lo = _mm_clmulepi64_si128(r, k3k4, 0x00), hi = _mm_clmulepi64_si128(r, k3k4, 0x11);
        r = _mm_xor_si128(_mm_xor_si128(lo, hi), _mm_loadu_si128((const __m128i *)buf));
    }
    /* 128 -> 64 bits, then 64 -> 32 by Barrett reduction */
    __m128i t = _mm_clmulepi64_si128(r, k3k4, 0x10);
    r = _mm_xor_si128(_mm_srli_si128(r, 8), t);
    t = _mm_srli_si128(r, 4);
    r = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(r, low32), k5, 0x00), t);
    t = _mm_clmulepi64_si128(_mm_and_si128(r, low32), poly, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(r, t), 1);
}

/* zlib.crc32(buf, crc): the CRC-32 of len bytes after crc. */
uint32_t kvc_crc32(const uint8_t *buf, int64_t len, uint32_t crc) {
    uint32_t c = ~crc;
    if (len >= 64) {
        const int64_t n = len & ~(int64_t)15;
        c = crc32_fold(buf, n, c);
        buf += n;
        len -= n;
    }
    return ~crc32_bytes(c, buf, len);
}
