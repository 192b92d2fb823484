// Decode attention: one query token per sequence over that sequence's keys and values.
//
// q[r, h, :] (strided), keys/values [Hkv, R, S, D] (strided over heads and sequences,
// contiguous rows), seq_lens[r] keys valid per sequence; query head h reads KV head
// h / (H / Hkv). out[r, h, :] = softmax(scale * q . k_j) @ v over j < seq_lens[r].
// One task per (KV head, sequence) pair, so rows of different lengths need no mask.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

#include "simd_exp.h"

namespace {

// One query head (NC chunks of 16 dims) over len keys/values; weights is scratch of >= len (+15).
template <int NC>
void attend(const float* q, const float* keys, const float* values, long len, float scale, float* weights,
            float* out) {
    constexpr long D = NC * 16;
    __m512 qv[NC];
    for (int c = 0; c < NC; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    float top = -INFINITY;
    for (long j = 0; j < len; j++) {
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys + j * D));
        for (int c = 1; c < NC; c++) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(keys + j * D + 16 * c), acc);
        weights[j] = _mm512_reduce_add_ps(acc) * scale;
        top = fmaxf(top, weights[j]);
    }
    __m512 total = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(top);
    for (long j = 0; j < len; j += 16) {
        __mmask16 live = len - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - j)) - 1);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, weights + j), shift));
        e = _mm512_maskz_mov_ps(live, e);
        _mm512_mask_storeu_ps(weights + j, live, e);
        total = _mm512_add_ps(total, e);
    }
    __m512 acc[NC];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (long j = 0; j < len; j++) {
        __m512 w = _mm512_set1_ps(weights[j]);
        for (int c = 0; c < NC; c++) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(values + j * D + 16 * c), acc[c]);
    }
    __m512 norm = _mm512_set1_ps(_mm512_reduce_add_ps(total));
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + 16 * c, _mm512_div_ps(acc[c], norm));
}

}  // namespace

// Returns 0 (and does nothing) for a head size other than 32, 64 or 128.
extern "C" int decode_attention(const float* q, long q_seq_stride, long q_head_stride, const float* k,
                                const float* v, long kv_head_stride, long kv_seq_stride, const int64_t* seq_lens,
                                long R, long H, long Hkv, long D, float scale, float* out, int threads) {
    if (D != 32 && D != 64 && D != 128) return 0;
    const long group = H / Hkv;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> weights;
#pragma omp for collapse(2) schedule(static)
        for (long kvh = 0; kvh < Hkv; kvh++) {
            for (long r = 0; r < R; r++) {
                const long len = seq_lens[r];
                const float* keys = k + kvh * kv_head_stride + r * kv_seq_stride;
                const float* values = v + kvh * kv_head_stride + r * kv_seq_stride;
                weights.resize(len + 16);
                for (long h = kvh * group; h < (kvh + 1) * group; h++) {
                    const float* qh = q + r * q_seq_stride + h * q_head_stride;
                    float* o = out + (r * H + h) * D;
                    if (D == 32) attend<2>(qh, keys, values, len, scale, weights.data(), o);
                    else if (D == 64) attend<4>(qh, keys, values, len, scale, weights.data(), o);
                    else attend<8>(qh, keys, values, len, scale, weights.data(), o);
                }
            }
        }
    }
    return 1;
}
