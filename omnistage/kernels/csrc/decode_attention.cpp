// Decode attention: each query token over its own sequence's first keys and values.
//
// q[t, h, :] (strided), keys/values [Hkv, S_rows, S, D] (strided over heads and sequences,
// contiguous rows); query token t reads sequence kv_rows[t] (t itself where kv_rows is null:
// one token per sequence, a decode step) and its first seq_lens[t] keys; query head h reads KV
// head h / (H / Hkv). out[t, h, :] = softmax(scale * q . k_j) @ v over j < seq_lens[t].
// A speculative verify step's tokens of one sequence read it up to their own positions, which
// is the causal mask. One task per (KV head, query token), so lengths differ freely.
#include <math.h>
#include <stdint.h>

#include <vector>

#include "simd_exp.h"

namespace {

// One query head (NC chunks of 16 dims) over len keys/values; weights is scratch of >= len (+15).
template <int NC>
void attend(const float* q, const float* keys, const float* values, long len, float scale, float* weights,
            float* out) {
    using namespace simd;
    constexpr long D = NC * 16;
    vf qv[NC];
    for (int c = 0; c < NC; c++) qv[c] = load(q + 16 * c);
    float top = -INFINITY;
    for (long j = 0; j < len; j++) {
        vf acc = mul(qv[0], load(keys + j * D));
        for (int c = 1; c < NC; c++) acc = fmadd(qv[c], load(keys + j * D + 16 * c), acc);
        weights[j] = reduce_add(acc) * scale;
        top = fmaxf(top, weights[j]);
    }
    vf total = zero();
    const vf shift = set1(top);
    for (long j = 0; j < len; j += 16) {
        const tail live = first(len - j);
        const vf e = keep(live, exp_ps(sub(load(weights + j, live), shift)));
        store(weights + j, live, e);
        total = add(total, e);
    }
    vf acc[NC];
    for (int c = 0; c < NC; c++) acc[c] = zero();
    for (long j = 0; j < len; j++) {
        const vf w = set1(weights[j]);
        for (int c = 0; c < NC; c++) acc[c] = fmadd(w, load(values + j * D + 16 * c), acc[c]);
    }
    const vf norm = set1(reduce_add(total));
    for (int c = 0; c < NC; c++) store(out + 16 * c, div(acc[c], norm));
}

}  // namespace

// Returns 0 (and does nothing) for a head size other than 32, 64 or 128.
extern "C" int decode_attention(const float* q, long q_seq_stride, long q_head_stride, const float* k,
                                const float* v, long kv_head_stride, long kv_seq_stride, const int64_t* kv_rows,
                                const int64_t* seq_lens, long R, long H, long Hkv, long D, float scale, float* out, int threads) {
    if (D != 32 && D != 64 && D != 128) return 0;
    const long group = H / Hkv;
    long keys = 0;
    for (long r = 0; r < R; r++) keys += seq_lens[r];
    // Below ~500k multiply-adds (a batch-1 context of a few hundred tokens) the calling thread alone is
    // faster than waking the pool, by far when the other cores are busy.
    const bool parallel = keys * H * D * 2 >= (1L << 19);
#pragma omp parallel num_threads(threads) if (parallel)
    {
        std::vector<float> weights;
#pragma omp for collapse(2) schedule(static)
        for (long kvh = 0; kvh < Hkv; kvh++) {
            for (long r = 0; r < R; r++) {
                const long len = seq_lens[r];
                const long row = kv_rows != nullptr ? kv_rows[r] : r;
                const float* keys = k + kvh * kv_head_stride + row * kv_seq_stride;
                const float* values = v + kvh * kv_head_stride + row * kv_seq_stride;
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
