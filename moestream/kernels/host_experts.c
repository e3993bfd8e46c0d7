/* Q4 experts computed on the host CPU from their records where they lie (the host tier), multi-threaded with
 * OpenMP. Built at first use by kernels/host_experts.py (cc -O3 -march=native -fopenmp), called through ctypes,
 * which releases the GIL while it runs.
 *
 * A record's projection is MLX affine Q4: codes [N, K/8] uint32 words (low nibble first), bf16 scales and biases
 * [N, K/64], w = scale * q + bias. Per group of 64 columns a row's dot is scale * sum(x q) + bias * sum(x), so the
 * codes are unpacked once to floats and reused for every token row routed to the expert. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 64
#define ROWS 4 /* token rows sharing one unpacking of a group's codes */

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float round_bf16(float f) { /* to the nearest bf16, ties to even: the GPU's h is bf16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* Within a group of 64 columns, x is read in "lane order": vector v (0..3) lane l (0..15) holds column
 * 8 * (l % 8) + 2 v + l / 8, the code that lane finds in word l % 8 shifted by 4 (2 v + l / 8). */
static inline int64_t lane_of(int64_t c) { return ((c & 7) >> 1) * 16 + (c & 1) * 8 + (c >> 3); }

/* y[t, n] (row stride ldy) = x[t, :K] . w[n, :K] for rows t < T and outputs n0 <= n < n1; x in lane order, xsum
 * [T, K/64]. */
static void q4_rows(const float *x, const float *xsum, int64_t T, int64_t K, const uint8_t *rec, int64_t w_off,
                    int64_t s_off, int64_t b_off, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t G = K / GROUP;
    for (int64_t n = n0; n < n1; n++) {
        const uint32_t *w = (const uint32_t *)(rec + w_off) + n * (K / 8);
        const uint16_t *s = (const uint16_t *)(rec + s_off) + n * G, *b = (const uint16_t *)(rec + b_off) + n * G;
        for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
            const int64_t rows = T - t0 < ROWS ? T - t0 : ROWS;
            float out[ROWS];
#if defined(__AVX512F__)
            __m512 acc[ROWS][4];  /* four chains a row: a group's FMAs do not wait on each other */
            for (int64_t r = 0; r < rows; r++) {
                out[r] = 0.0f;
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
            }
            const __m512i mask = _mm512_set1_epi32(15);
            for (int64_t g = 0; g < G; g++) {
                const __m512i words = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + g * 8)));
                const __m512 scale = _mm512_set1_ps(from_bf16(s[g]));
                __m512 q[4];
                for (int v = 0; v < 4; v++) {
                    const __m512i shift = _mm512_set_epi32(8 * v + 4, 8 * v + 4, 8 * v + 4, 8 * v + 4, 8 * v + 4,
                                                           8 * v + 4, 8 * v + 4, 8 * v + 4, 8 * v, 8 * v, 8 * v,
                                                           8 * v, 8 * v, 8 * v, 8 * v, 8 * v);
                    q[v] = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shift),
                                                                                       mask)));
                }
                const float bias = from_bf16(b[g]);
                for (int64_t r = 0; r < rows; r++) {
                    const float *xt = x + (t0 + r) * K + g * GROUP;
                    for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 16 * v), q[v], acc[r][v]);
                    out[r] += bias * xsum[(t0 + r) * G + g];
                }
            }
            for (int64_t r = 0; r < rows; r++) y[(t0 + r) * ldy + n] = out[r] + _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
#else
            for (int64_t r = 0; r < rows; r++) out[r] = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                float q[GROUP];
                for (int i = 0; i < GROUP; i++) q[i] = (float)((w[g * 8 + (i & 7)] >> (4 * (2 * (i >> 4) + ((i >> 3) & 1)))) & 15u);
                for (int64_t r = 0; r < rows; r++) {
                    const float *xt = x + (t0 + r) * K + g * GROUP;
                    float dot = 0.0f;
                    for (int i = 0; i < GROUP; i++) dot += xt[i] * q[i];
                    out[r] += from_bf16(s[g]) * dot + from_bf16(b[g]) * xsum[(t0 + r) * G + g];
                }
            }
            for (int64_t r = 0; r < rows; r++) y[(t0 + r) * ldy + n] = out[r];
#endif
        }
    }
}

/* Experts e < E (record at records[e]) over their rows: expert e owns rows spans[e]..spans[e+1] of x [M, H]
 * (fp32, gathered by the caller, in lane order) and writes them in y [M, H]. g, u, h [M, I] and hsum [M, I/64]
 * are scratch. The
 * offsets name each field's byte offset in a record: gate_w, gate_s, gate_b, up_w, up_s, up_b, down_w, down_s,
 * down_b; `threads` OpenMP threads share the work. Work is split over (expert, block of output rows), so a row's arithmetic never depends on the split. */
void q4_experts(const float *x, const float *xsum, const int64_t *spans, const uint64_t *records, int64_t E,
                int64_t H, int64_t I, const int64_t *off, int64_t threads, float *g, float *u, float *h, float *hsum, float *y) {
    const int64_t BLOCK = 32, up_blocks = I / BLOCK, down_blocks = H / BLOCK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < E * up_blocks; task++) {
        const int64_t e = task / up_blocks, n0 = (task % up_blocks) * BLOCK, a = spans[e], T = spans[e + 1] - a;
        const uint8_t *rec = (const uint8_t *)(uintptr_t)records[e];
        q4_rows(x + a * H, xsum + a * (H / GROUP), T, H, rec, off[0], off[1], off[2], n0, n0 + BLOCK, g + a * I, I);
        q4_rows(x + a * H, xsum + a * (H / GROUP), T, H, rec, off[3], off[4], off[5], n0, n0 + BLOCK, u + a * I, I);
        for (int64_t t = a; t < a + T; t++)  /* h in lane order: down reads it as x */
            for (int64_t n = n0; n < n0 + BLOCK; n++) {
                const float gate = g[t * I + n];
                h[t * I + (n & ~(int64_t)(GROUP - 1)) + lane_of(n & (GROUP - 1))] =
                    round_bf16(gate / (1.0f + expf(-gate)) * u[t * I + n]);
            }
    }
    const int64_t M = spans[E], GI = I / GROUP;
#pragma omp parallel for num_threads(threads)
    for (int64_t t = 0; t < M; t++)
        for (int64_t k = 0; k < GI; k++) {
            float sum = 0.0f;
            for (int i = 0; i < GROUP; i++) sum += h[t * I + k * GROUP + i];
            hsum[t * GI + k] = sum;
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < E * down_blocks; task++) {
        const int64_t e = task / down_blocks, n0 = (task % down_blocks) * BLOCK, a = spans[e], T = spans[e + 1] - a;
        const uint8_t *rec = (const uint8_t *)(uintptr_t)records[e];
        q4_rows(h + a * I, hsum + a * GI, T, I, rec, off[6], off[7], off[8], n0, n0 + BLOCK, y + a * H, H);
    }
}
