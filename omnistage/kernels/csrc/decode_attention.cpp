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

// Query heads sharing a KV head are done G at a time, so each key and value is read once for
// all G: up to 4, and G * NC <= 16 (their G * NC value sums stay in registers).
constexpr int kMaxHeads = 4;
constexpr int heads_at_once(int nc) { return 16 / nc < kMaxHeads ? 16 / nc : kMaxHeads; }

// Lane i: q . key i (NC chunks of 16 dims each) for the first live (<= 16) keys from keys, 0 past
// them; each dot product as 16 lane partial sums, folded for all 16 keys at once by reduce_add16
// (the additions reduce_add would make, batched, so the bits of a key's score never depend on
// its neighbours).
template <int NC>
inline simd::vf dots16(const simd::vf* q, const float* keys, long live) {
    using namespace simd;
    vf dots[16];
    for (int i = 0; i < 16; i++) {
        dots[i] = zero();
        if (i >= live) continue;
        const float* key = keys + i * NC * 16;
        dots[i] = mul(q[0], load(key));
        for (int c = 1; c < NC; c++) dots[i] = fmadd(q[c], load(key + 16 * c), dots[i]);
    }
    return reduce_add16(dots);
}

// G consecutive query heads of one KV head (NC chunks of 16 dims) over len keys/values. Head g's
// query is q + g * q_head_stride, its output out + g * NC * 16; weights is scratch of
// >= G * (len + 16). Each head's arithmetic is what it would be alone, in the same order.
template <int NC, int G>
void attend(const float* q, long q_head_stride, const float* keys, const float* values, long len, float scale,
            float* weights, float* out) {
    using namespace simd;
    constexpr long D = NC * 16;
    const long stride = len + 16;
    // Scores, 16 keys at a time. The block's keys stay in L1 while the G heads read them; each
    // head's query is reloaded from there too (all G in registers beside 16 sums would spill).
    const vf scale16 = set1(scale);
    vf highest[G];
    float top[G];
    for (int g = 0; g < G; g++) highest[g] = set1(-INFINITY), top[g] = -INFINITY;
    for (long j = 0; j < len; j += 16) {
        const long live = len - j < 16 ? len - j : 16;
        for (int g = 0; g < G; g++) {
            vf qv[NC];
            for (int c = 0; c < NC; c++) qv[c] = load(q + g * q_head_stride + 16 * c);
            float* wg = weights + g * stride + j;
            if (live == 16) {
                const vf w = mul(dots16<NC>(qv, keys + j * D, 16), scale16);
                store(wg, w);
                highest[g] = max(highest[g], w);
            } else {  // the last len % 16 keys
                store(wg, first(live), mul(dots16<NC>(qv, keys + j * D, live), scale16));
                for (long i = 0; i < live; i++) top[g] = fmaxf(top[g], wg[i]);
            }
        }
    }
    for (int g = 0; g < G; g++) top[g] = fmaxf(top[g], reduce_max(highest[g]));
    float norm[G];
    for (int g = 0; g < G; g++) {
        float* wg = weights + g * stride;
        vf total = zero();
        const vf shift = set1(top[g]);
        for (long j = 0; j < len; j += 16) {
            const tail live = first(len - j);
            const vf e = keep(live, exp_ps(sub(load(wg + j, live), shift)));
            store(wg + j, live, e);
            total = add(total, e);
        }
        norm[g] = reduce_add(total);
    }
    // Weighted values: each value row loaded once for the G heads.
    vf acc[G][NC];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NC; c++) acc[g][c] = zero();
    for (long j = 0; j < len; j++) {
        vf row[NC];
        for (int c = 0; c < NC; c++) row[c] = load(values + j * D + 16 * c);
        for (int g = 0; g < G; g++) {
            const vf w = set1(weights[g * stride + j]);
            for (int c = 0; c < NC; c++) acc[g][c] = fmadd(w, row[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++) {
        const vf n = set1(norm[g]);
        for (int c = 0; c < NC; c++) store(out + g * D + 16 * c, div(acc[g][c], n));
    }
}

// n consecutive query heads of one KV head, G at a time, then the rest together.
template <int NC, int G = heads_at_once(NC)>
void attend_heads(const float* q, long q_head_stride, const float* keys, const float* values, long len,
                  float scale, float* weights, float* out, long n) {
    constexpr long D = NC * 16;
    long h = 0;
    for (; h + G <= n; h += G)
        attend<NC, G>(q + h * q_head_stride, q_head_stride, keys, values, len, scale, weights, out + h * D);
    const float* qh = q + h * q_head_stride;
    float* oh = out + h * D;
    switch (n - h) {
        case 1: attend<NC, 1>(qh, q_head_stride, keys, values, len, scale, weights, oh); break;
        case 2: if constexpr (G > 2) attend<NC, 2>(qh, q_head_stride, keys, values, len, scale, weights, oh); break;
        case 3: if constexpr (G > 3) attend<NC, 3>(qh, q_head_stride, keys, values, len, scale, weights, oh); break;
        default: break;
    }
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
                weights.resize(kMaxHeads * (len + 16));
                const float* qh = q + r * q_seq_stride + kvh * group * q_head_stride;
                float* oh = out + (r * H + kvh * group) * D;
                if (D == 32) attend_heads<2>(qh, q_head_stride, keys, values, len, scale, weights.data(), oh, group);
                else if (D == 64) attend_heads<4>(qh, q_head_stride, keys, values, len, scale, weights.data(), oh, group);
                else attend_heads<8>(qh, q_head_stride, keys, values, len, scale, weights.data(), oh, group);
            }
        }
    }
    return 1;
}
