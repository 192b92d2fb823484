// A whole decode step's decoder layers in one call: the lean decoder's per-layer sequence of
// native calls (models/fast_forward.py), made from here instead of from Python.
//
// At batch 1 a layer's math is about a dozen short kernel calls; from Python each costs a few
// microseconds of argument checks, tensor allocation and ctypes marshalling, about a third of
// the step. Here the same kernels run in the same order on the same inputs, so the result is bit
// for bit the Python sequence's. Only a step of a few tokens per sequence (plain decode, a
// speculative verify step) that continues every layer's dense decode view comes here (its
// keys/values go to the paged cache and the view, attention reads the view); any other step
// keeps the Python sequence.
#include <stdint.h>

#include <vector>

extern "C" {
void group_int8_gemm(const float* x, long M, long K, const void* q, int bits, const uint16_t* d, const uint16_t* m,
                     float* y, long N, int threads);
void rms_norm(const float* x, long M, long K, const float* weight, float eps, float* out, int threads);
void rope(const float* x, long T, long H, long D, long x_stride, const float* cos, const float* sin, float* out,
          int threads);
void silu_mul(const float* gu, long M, long I, float* out, int threads);
void kv_store(const float* k, long k_hs, long k_ts, const float* v, long v_hs, long v_ts, long H, long T, long D,
              float* dst_k, float* dst_v, long dst_hs, const int64_t* idx, float* dense_k, float* dense_v,
              long dense_hs, const int64_t* dense_idx);
int decode_attention(const float* q, long q_seq_stride, long q_head_stride, const float* k, const float* v,
                     long kv_head_stride, long kv_seq_stride, const int64_t* kv_rows, const int64_t* seq_lens, long R,
                     long H, long Hkv, long D, float scale, float* out, int threads);
}

// One group-int8 linear: y[M, n] = x[M, k] @ w^T (+ bias, added after the product, as torch's add_).
struct Linear {
    const void* q;
    const uint16_t* d;
    const uint16_t* m;
    const float* bias;  // null: none
    long n, k;
    int bits;
};

namespace {

void linear(const Linear& w, const float* x, long M, float* y, int threads) {
    group_int8_gemm(x, M, w.k, w.q, w.bits, w.d, w.m, y, w.n, threads);
    if (w.bias != nullptr)
        for (long r = 0; r < M; r++)
            for (long i = 0; i < w.n; i++) y[r * w.n + i] = y[r * w.n + i] + w.bias[i];
}

void add_into(float* h, const float* y, long n) {
    for (long i = 0; i < n; i++) h[i] = h[i] + y[i];
}

}  // namespace

extern "C" {

// What one layer holds: its weights (fixed at load) and, per step, its paged cache and dense view.
struct DecodeLayer {
    const float* in_norm;
    const float* post_norm;
    float in_eps, post_eps, scaling;
    Linear qkv, o, gate_up, down;
    float* cache_k;  // the layer's paged cache, [Hkv, slots, D] per half (head stride cache_hs)
    float* cache_v;
    float* dense_k;  // its dense decode view, [Hkv, rows, capacity, D] per half (head stride dense_hs)
    float* dense_v;
};

// h [R, hidden] (R tokens, updated in place) through `num_layers` layers. cos/sin [R, D]
// (sign-folded, see fast_forward.rope_tables); slots [R] the tokens' cache slots, dense_idx [R]
// their columns in the flattened [rows * capacity] view, kv_rows [R] their sequences' view rows
// (null: token r is row r, a decode step), seq_lens [R] the keys each token reads (its position + 1).
void decode_layers(const DecodeLayer* layers, long num_layers, float* h, long R, long hidden, long H, long Hkv,
                   long D, const float* cos, const float* sin, const int64_t* slots, long cache_hs,
                   const int64_t* dense_idx, long capacity, long dense_hs, const int64_t* kv_rows,
                   const int64_t* seq_lens, int threads) {
    const long nqk = H + Hkv, nqkv = nqk + Hkv;
    const long inter = layers[0].gate_up.n / 2;
    std::vector<float> x(R * hidden), qkv(R * nqkv * D), qk(R * nqk * D), attn(R * H * D), y(R * hidden),
        gu(R * 2 * inter), act(R * inter);
    for (long l = 0; l < num_layers; l++) {
        const DecodeLayer& L = layers[l];
        rms_norm(h, R, hidden, L.in_norm, L.in_eps, x.data(), threads);
        linear(L.qkv, x.data(), R, qkv.data(), threads);
        rope(qkv.data(), R, nqk, D, nqkv * D, cos, sin, qk.data(), threads);
        // Keys: the roped rows after the query heads; values: straight from the projection.
        kv_store(qk.data() + H * D, D, nqk * D, qkv.data() + nqk * D, D, nqkv * D, Hkv, R, D, L.cache_k, L.cache_v,
                 cache_hs, slots, L.dense_k, L.dense_v, dense_hs, dense_idx);
        decode_attention(qk.data(), nqk * D, D, L.dense_k, L.dense_v, dense_hs, capacity * D, kv_rows, seq_lens, R, H,
                         Hkv, D, L.scaling, attn.data(), threads);
        linear(L.o, attn.data(), R, y.data(), threads);
        add_into(h, y.data(), R * hidden);
        rms_norm(h, R, hidden, L.post_norm, L.post_eps, x.data(), threads);
        linear(L.gate_up, x.data(), R, gu.data(), threads);
        silu_mul(gu.data(), R, inter, act.data(), threads);
        linear(L.down, act.data(), R, y.data(), threads);
        add_into(h, y.data(), R * hidden);
    }
}

}  // extern "C"
