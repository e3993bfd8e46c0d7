/* Q4 experts computed on the host CPU from their records where they lie (the host tier), multi-threaded with
 * OpenMP. Built at first use by kernels/host_experts.py (cc -O3 -march=native -fopenmp), called through ctypes,
 * which releases the GIL while it runs.
 *
 * A record's projection is MLX affine Q4: codes [N, K/8] uint32 words (low nibble first), bf16 scales and biases
 * [N, K/64], w = scale * q + bias. As the GPU's prefill kernel does, each weight is dequantized in fp32, rounded
 * to bf16 and multiplied by bf16 activations with fp32 sums; the sums' order is this kernel's own. With
 * AVX512-BF16 a group's 64 weights are unpacked once into two vectors of 32 bf16 and reused for every token row
 * routed to the expert (VDPBF16PS: two products a lane); elsewhere a portable loop. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define GROUP 64
#define ROWS 4  /* token rows sharing one unpacking of a group's codes */
#define BLOCK 32 /* output rows a task computes */

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* nearest, ties to even */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* Within a group of 64 columns activations are stored in "lane order": position p = 16 v + l (v < 4, l < 16)
 * holds column 8 (l % 8) + 2 v + l / 8, the code lane l of unpacking v finds in word l % 8 shifted by
 * 4 (2 v + l / 8). */
static inline int64_t lane_of(int64_t c) { return ((c & 7) >> 1) * 16 + (c & 1) * 8 + (c >> 3); }

/* y[t, n] (row stride ldy) = x[t, :K] . w[n, :K] for rows t < T and outputs n0 <= n < n0 + BLOCK; x bf16 in lane
 * order. The block's weights are unpacked to bf16 once (wbuf, BLOCK * K bf16), then read for every 4 token rows,
 * whose activations stay in L1 while the block's rows pass. */
static void q4_rows(const uint16_t *x, int64_t T, int64_t K, const uint8_t *rec, int64_t w_off, int64_t s_off,
                    int64_t b_off, int64_t n0, float *y, int64_t ldy, uint16_t *wbuf) {
    const int64_t G = K / GROUP;
    for (int64_t i = 0; i < BLOCK; i++) {
        const int64_t n = n0 + i;
        const uint32_t *w = (const uint32_t *)(rec + w_off) + n * (K / 8);
        const uint16_t *s = (const uint16_t *)(rec + s_off) + n * G, *b = (const uint16_t *)(rec + b_off) + n * G;
        uint16_t *row = wbuf + i * K;
#if defined(__AVX512BF16__)
        const __m512i mask = _mm512_set1_epi32(15);
        for (int64_t g = 0; g < G; g++) {
            const __m512i words = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + g * 8)));
            const __m512 scale = _mm512_set1_ps(from_bf16(s[g])), bias = _mm512_set1_ps(from_bf16(b[g]));
            __m512 q[4];
            for (int v = 0; v < 4; v++) {
                const int lo = 8 * v, hi = 8 * v + 4;
                const __m512i shift = _mm512_set_epi32(hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo);
                const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(words, shift), mask);
                q[v] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(codes), bias);
            }
            _mm512_storeu_si512(row + g * GROUP, (__m512i)_mm512_cvtne2ps_pbh(q[1], q[0]));
            _mm512_storeu_si512(row + g * GROUP + 32, (__m512i)_mm512_cvtne2ps_pbh(q[3], q[2]));
        }
#else
        for (int64_t g = 0; g < G; g++) {
            const float scale = from_bf16(s[g]), bias = from_bf16(b[g]);
            for (int p = 0; p < GROUP; p++) {
                const int v = p >> 4, l = p & 15;
                const uint32_t code = (w[g * 8 + (l & 7)] >> (4 * (2 * v + (l >> 3)))) & 15u;
                row[g * GROUP + p] = to_bf16(scale * (float)code + bias);
            }
        }
#endif
    }
    for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
        const int64_t rows = T - t0 < ROWS ? T - t0 : ROWS;
        for (int64_t i = 0; i < BLOCK; i++) {
            const uint16_t *row = wbuf + i * K;
#if defined(__AVX512BF16__)
            __m512 acc[ROWS][2];
            for (int64_t r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += GROUP) {
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k), w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
                for (int64_t r = 0; r < rows; r++) {
                    const uint16_t *xt = x + (t0 + r) * K + k;
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_loadu_si512(xt), w0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_loadu_si512(xt + 32), w1);
                }
            }
            for (int64_t r = 0; r < rows; r++)
                y[(t0 + r) * ldy + n0 + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#else
            for (int64_t r = 0; r < rows; r++) {
                const uint16_t *xt = x + (t0 + r) * K;
                float dot = 0.0f;
                for (int64_t k = 0; k < K; k++) dot += from_bf16(xt[k]) * from_bf16(row[k]);
                y[(t0 + r) * ldy + n0 + i] = dot;
            }
#endif
        }
    }
}

/* Experts e < E (record at records[e]) over their rows: expert e owns rows spans[e]..spans[e+1] of x [M, H]
 * (bf16, gathered by the caller, in lane order) and writes them in y [M, H] (fp32). g, u [M, I] (fp32) and
 * h [M, I] (bf16) are scratch. `off` names each field's byte offset in a record: gate_w, gate_s, gate_b, up_w,
 * up_s, up_b, down_w, down_s, down_b; `threads` OpenMP threads share the work, split over (expert, block of
 * output rows), so a row's arithmetic never depends on the split. */
void q4_experts(const uint16_t *x, const int64_t *spans, const uint64_t *records, int64_t E, int64_t H, int64_t I,
                const int64_t *off, int64_t threads, float *g, float *u, uint16_t *h, float *y) {
    const int64_t up_blocks = I / BLOCK, down_blocks = H / BLOCK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < E * up_blocks; task++) {
        const int64_t e = task / up_blocks, n0 = (task % up_blocks) * BLOCK, a = spans[e], T = spans[e + 1] - a;
        const uint8_t *rec = (const uint8_t *)(uintptr_t)records[e];
        uint16_t *wbuf = malloc(BLOCK * H * sizeof(uint16_t));
        q4_rows(x + a * H, T, H, rec, off[0], off[1], off[2], n0, g + a * I, I, wbuf);
        q4_rows(x + a * H, T, H, rec, off[3], off[4], off[5], n0, u + a * I, I, wbuf);
        free(wbuf);
        for (int64_t t = a; t < a + T; t++) /* h in lane order: down reads it as x */
            for (int64_t n = n0; n < n0 + BLOCK; n++) {
                const float gate = g[t * I + n];
                h[t * I + (n & ~(int64_t)(GROUP - 1)) + lane_of(n & (GROUP - 1))] =
                    to_bf16(gate / (1.0f + expf(-gate)) * u[t * I + n]);
            }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < E * down_blocks; task++) {
        const int64_t e = task / down_blocks, n0 = (task % down_blocks) * BLOCK, a = spans[e], T = spans[e + 1] - a;
        const uint8_t *rec = (const uint8_t *)(uintptr_t)records[e];
        uint16_t *wbuf = malloc(BLOCK * I * sizeof(uint16_t));
        q4_rows(h + a * I, T, I, rec, off[6], off[7], off[8], n0, y + a * H, H, wbuf);
        free(wbuf);
    }
}
