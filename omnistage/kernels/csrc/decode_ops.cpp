// The lean decoder's elementwise steps, one call each instead of several torch ops.
//
// A single row (a batch-1 decode step) runs on the calling thread: waking the pool would cost more
// than the row's work.
//
// Each keeps the roundings of the torch expression it replaces (the build turns off
// floating-point contraction, so a * b + c stays two roundings), except where noted:
// rms_norm sums its squares in another order, silu_mul's exp is exp_ps.
#include <math.h>
#include <stdint.h>

#include "simd_exp.h"

using namespace simd;

extern "C" {

// out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)) for x [M, K] contiguous: HF's RMSNorm in fp32.
void rms_norm(const float* x, long M, long K, const float* weight, float eps, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (long r = 0; r < M; r++) {
        const float* row = x + r * K;
        vf acc = zero();
        for (long i = 0; i < K; i += 16) {
            const vf v = load(row + i, first(K - i));
            acc = add(acc, mul(v, v));
        }
        const float inv = 1.0f / sqrtf(reduce_add(acc) / (float)K + eps);
        const vf scale = set1(inv);
        for (long i = 0; i < K; i += 16) {
            const tail m = first(K - i);
            const vf v = mul(load(row + i, m), scale);
            store(out + r * K + i, m, mul(load(weight + i, m), v));
        }
    }
}

// RoPE on q and k together: out[t, h, i] = x[t, h, i] * cos[t, i] + x[t, h, (i + D/2) % D] * sin[t, i],
// sin with rotate_half's sign folded in; x [T, H, D] with row stride x_stride (heads contiguous),
// cos/sin [T, D], out [T, H, D] contiguous. Bit-identical to x * cos + roll(x, D/2, -1) * sin.
void rope(const float* x, long T, long H, long D, long x_stride, const float* cos, const float* sin, float* out,
          int threads) {
    const long half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
    for (long t = 0; t < T; t++) {
        for (long h = 0; h < H; h++) {
            const float* in = x + t * x_stride + h * D;
            float* o = out + (t * H + h) * D;
            for (long i = 0; i < D; i += 16) {
                const tail m = first(D - i);
                // Lanes i..i+15 read the other half at (i + half) % D; D/2 a multiple of 16 keeps them in one run.
                const long j = (i + half) % D;
                const vf a = mul(load(in + i, m), load(cos + t * D + i, m));
                const vf b = mul(load(in + j, m), load(sin + t * D + i, m));
                store(o + i, m, add(a, b));
            }
        }
    }
}

// out[r, i] = silu(gu[r, i]) * gu[r, I + i] for gu [M, 2I] contiguous; silu(x) = x / (1 + e^-x) as torch.
void silu_mul(const float* gu, long M, long I, float* out, int threads) {
    const vf one = set1(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (long r = 0; r < M; r++) {
        const float* gate = gu + r * 2 * I;
        for (long i = 0; i < I; i += 16) {
            const tail m = first(I - i);
            const vf g = load(gate + i, m);
            const vf s = div(g, add(one, exp_ps(sub(zero(), g))));
            store(out + r * I + i, m, mul(s, load(gate + I + i, m)));
        }
    }
}

}  // extern "C"

extern "C" {

// A decode step's new keys/values, [H, T, D] each (head stride *_hs, token stride *_ts, rows contiguous),
// copied to row idx[t] of every head of one or two destinations: dst_k/dst_v [H, rows, D] with head
// stride dst_hs (the paged cache's flat slots), and, unless dense_k is null, dense_k/dense_v with
// head stride dense_hs at rows dense_idx[t] (the layer's dense decode view). Plain copies.
void kv_store(const float* k, long k_hs, long k_ts, const float* v, long v_hs, long v_ts, long H, long T, long D,
              float* dst_k, float* dst_v, long dst_hs, const int64_t* idx, float* dense_k, float* dense_v,
              long dense_hs, const int64_t* dense_idx) {
    for (long h = 0; h < H; h++) {
        for (long t = 0; t < T; t++) {
            const float* ks = k + h * k_hs + t * k_ts;
            const float* vs = v + h * v_hs + t * v_ts;
            float* dk = dst_k + h * dst_hs + idx[t] * D;
            float* dv = dst_v + h * dst_hs + idx[t] * D;
            for (long i = 0; i < D; i++) { dk[i] = ks[i]; dv[i] = vs[i]; }
            if (dense_k != nullptr) {
                float* ek = dense_k + h * dense_hs + dense_idx[t] * D;
                float* ev = dense_v + h * dense_hs + dense_idx[t] * D;
                for (long i = 0; i < D; i++) { ek[i] = ks[i]; ev[i] = vs[i]; }
            }
        }
    }
}

}  // extern "C"
