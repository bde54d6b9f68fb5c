/* A linear's whole step in one foreign call: its activations quantized into the calling thread's
 * memory, then its weights' kernel (int4 kept as panels, int8), one weight or several that take
 * the same input. A decode step makes ~4 such calls a layer, and Python's part of each (three
 * tensors for the quantized activations, a call of their own) cost about what a small linear's
 * kernel does; the numbers are the same kernels' on the same 8-bit activations. */
#include "kvc.h"

/* A call's quantized activations up to this size stay with the thread for its next call
 * (decode and verification steps); a prompt's larger ones are allocated for their call. */
#define LINEAR_KEEP (8 << 20)

/* spec: [kind, count, cols, w[count], scales[count], offsets[count], outs[count]] (addresses;
 * int8 weights' offsets 0), as matmul._Group builds it once a group. ys: the outputs'
 * addresses ([rows, outs[i]] each; bfloat16 where y_bf16 and the kernel writes it, int4's,
 * else float32). x: float32, or bfloat16 where x_bf16, [rows, cols]. Returns 0, -1 without
 * memory, -2 for a spec this file does not know. */
int kvc_linear(const int64_t *spec, const void *x, int x_bf16, int64_t rows, const int64_t *ys, int y_bf16,
               int threads) {
    const int64_t kind = spec[0], count = spec[1], cols = spec[2];
    const int64_t *w = spec + 3, *scales = w + count, *offsets = scales + count, *outs = offsets + count;
    if (count < 1 || cols % BLOCK || (kind != LINEAR_Q4P && kind != LINEAR_Q8 && kind != LINEAR_Q8P)) return -2;
    if (rows <= 0) return 0;
    const int64_t blocks = rows * (cols / BLOCK);
    const int64_t bytes = rows * cols + 2 * blocks * (int64_t)sizeof(float);
    uint8_t *held = bytes <= LINEAR_KEEP ? thread_kept(KEPT_LINEAR_ACTS, bytes) : NULL;
    uint8_t *mem = held ? held : malloc((size_t)bytes);
    if (!mem) return -1;
    int8_t *xq = (int8_t *)mem;
    float *xd = (float *)(mem + rows * cols), *xs = xd + blocks;
    kvc_quantize_q8(x, x_bf16, rows, cols, xq, xd, xs, threads);
    int status = 0;
    if (kind == LINEAR_Q4P && count == 1)
        kvc_gemm_q4p((const uint8_t *)w[0], (const uint16_t *)scales[0], (const uint16_t *)offsets[0], outs[0], cols,
                     xq, xd, xs, rows, (void *)ys[0], y_bf16, threads);
    else if (kind == LINEAR_Q4P)
        status = kvc_gemm_q4p_many(w, scales, offsets, outs, ys, count, cols, xq, xd, xs, rows, y_bf16, threads);
    else if (kind == LINEAR_Q8P)
        status = kvc_gemm_q8p_many(w, scales, outs, ys, count, cols, xq, xd, rows, threads);
    else if (count == 1)
        kvc_gemm_q8((const int8_t *)w[0], (const float *)scales[0], outs[0], cols, xq, xd, rows, (float *)ys[0],
                    threads);
    else
        status = kvc_gemm_q8_many(w, scales, outs, ys, count, cols, xq, xd, rows, threads);
    if (!held) free(mem);
    return status;
}
