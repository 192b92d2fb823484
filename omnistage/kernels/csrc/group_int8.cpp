// Group-int8 weights: w[n, k] = fma(d[n, g], q[n, k], m[n, g]) with g = k / 32, q int8.
//
// This is how GGUF's Q4_1 (q in 0..15, m = the group's minimum) and Q8_0
// (q in -127..127, m = 0) blocks dequantize to fp32, so a checkpoint loaded
// from such a file has this form exactly. group_int8_encode recovers it from
// the fp32 weights (and refuses unless every weight is reproduced bit for
// bit); group_int8_gemm multiplies fp32 activations by it, rebuilding the
// very same fp32 weights in registers, so only the summation order differs
// from a plain fp32 matmul, while memory traffic drops from 4 to 1.25 bytes
// per weight.
//
// Layout, tiled by 32 output columns: q[tile][k][32] int8, d/m[tile][g][32] fp32.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

namespace {

constexpr long kGroup = 32;
constexpr long kTile = 32;
constexpr long kMaxK = 1 << 14;

// One k's 32 weights of a tile, rebuilt exactly: d * q is exact in fp32 (11-bit d, 8-bit q),
// so fma(d, q, m) rounds once, like the GGUF dequantizer's d * q + m.
inline void load_weights(const int8_t* q, __m512 d0, __m512 d1, __m512 m0, __m512 m1, __m512* b0, __m512* b1) {
    __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
    __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
    *b0 = _mm512_fmadd_ps(d0, q0, m0);
    *b1 = _mm512_fmadd_ps(d1, q1, m1);
}

// MR rows' accumulators for one tile's 32 output columns.
template <int MR>
struct RowBlock {
    __m512 acc0[MR], acc1[MR];

    RowBlock() {
        for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    }
    // Adds x[r, k] times the tile's 32 weights at k (b0, b1) to every row r.
    inline void add(const float* x, long ldx, long k, __m512 b0, __m512 b1) {
        for (int r = 0; r < MR; r++) {
            __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
        }
    }
    inline void store(float* y, long ldy) const {
        for (int r = 0; r < MR; r++) {
            _mm512_storeu_ps(y + r * ldy, acc0[r]);
            _mm512_storeu_ps(y + r * ldy + 16, acc1[r]);
        }
    }
};

// MR rows of x times a tile's weights already rebuilt into panel[K][32] (several row blocks reuse it).
template <int MR>
void rows_times_panel(const float* x, long K, const float* panel, float* y, long ldy) {
    RowBlock<MR> rows;
    for (long k = 0; k < K; k++) rows.add(x, K, k, _mm512_load_ps(panel + k * 32), _mm512_load_ps(panel + k * 32 + 16));
    rows.store(y, ldy);
}

// MR (1 or 2) rows straight from the int8 weights: with so few rows, a panel would not be reused.
template <int MR>
void rows_times_tile(const float* x, long K, const int8_t* q, const float* d, const float* m, float* y, long ldy) {
    RowBlock<MR> rows;
    for (long g = 0; g < K / kGroup; g++) {
        __m512 d0 = _mm512_loadu_ps(d + g * 32), d1 = _mm512_loadu_ps(d + g * 32 + 16);
        __m512 m0 = _mm512_loadu_ps(m + g * 32), m1 = _mm512_loadu_ps(m + g * 32 + 16);
        for (long k = g * kGroup; k < (g + 1) * kGroup; k++) {
            __m512 b0, b1;
            load_weights(q + k * 32, d0, d1, m0, m1, &b0, &b1);
            rows.add(x, K, k, b0, b1);
        }
    }
    rows.store(y, ldy);
}

void rows_tail(long rows, const float* x, long K, const float* panel, float* y, long ldy) {
    switch (rows) {
        case 7: rows_times_panel<7>(x, K, panel, y, ldy); break;
        case 6: rows_times_panel<6>(x, K, panel, y, ldy); break;
        case 5: rows_times_panel<5>(x, K, panel, y, ldy); break;
        case 4: rows_times_panel<4>(x, K, panel, y, ldy); break;
        case 3: rows_times_panel<3>(x, K, panel, y, ldy); break;
        case 2: rows_times_panel<2>(x, K, panel, y, ldy); break;
        case 1: rows_times_panel<1>(x, K, panel, y, ldy); break;
        default: break;
    }
}

inline float fp16_round(float x, int step) {
    uint16_t h = (uint16_t)(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT) + step);
    return _cvtsh_ss(h);
}

// Whether all 32 weights w == fma(d, q, m) for integers q in [lo, hi]; those q go to q_out[i * stride].
bool fits(__m512 w0, __m512 w1, float d, float m, float lo, float hi, int8_t* q_out, long stride) {
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    const __m512 lov = _mm512_set1_ps(lo), hiv = _mm512_set1_ps(hi);
    __m512 q[2];
    const __m512 w[2] = {w0, w1};
    for (int h = 0; h < 2; h++) {
        q[h] = d == 0.0f ? _mm512_setzero_ps()
                         : _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(w[h], mv), dv), _MM_FROUND_TO_NEAREST_INT);
        __mmask16 ok = _mm512_cmp_ps_mask(q[h], lov, _CMP_GE_OQ) & _mm512_cmp_ps_mask(q[h], hiv, _CMP_LE_OQ) &
                       _mm512_cmp_ps_mask(_mm512_fmadd_ps(dv, q[h], mv), w[h], _CMP_EQ_OQ);
        if (ok != 0xFFFF) return false;
    }
    alignas(64) int32_t qi[32];
    _mm512_store_si512((__m512i*)qi, _mm512_cvtps_epi32(q[0]));
    _mm512_store_si512((__m512i*)(qi + 16), _mm512_cvtps_epi32(q[1]));
    for (long i = 0; i < kGroup; i++) q_out[i * stride] = (int8_t)qi[i];
    return true;
}

// One group of 32 weights: the Q4_1 layout first, then Q8_0's; d is an fp16 value near its estimate.
bool encode_group(const float* w, int8_t* q, long stride, float* d, float* m) {
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    const float lo = _mm512_reduce_min_ps(_mm512_min_ps(w0, w1));
    const float hi = _mm512_reduce_max_ps(_mm512_max_ps(w0, w1));
    const float amax = fmaxf(fabsf(lo), fabsf(hi));
    static const int steps[3] = {0, 1, -1};  // the fp16 rounding of the estimate, then its neighbours
    for (int step : steps) {
        const float cand = fp16_round((hi - lo) / 15.0f, step);
        if (fits(w0, w1, cand, lo, 0.0f, 15.0f, q, stride)) { *d = cand; *m = lo; return true; }
    }
    for (int step : steps) {
        const float cand = fp16_round(amax / 127.0f, step);
        if (fits(w0, w1, cand, 0.0f, -127.0f, 127.0f, q, stride)) { *d = cand; *m = 0.0f; return true; }
    }
    return false;
}

}  // namespace

extern "C" {

// y[M, N] = x[M, K] @ w^T for the tiled group-int8 w (N, K multiples of 32, K <= kMaxK).
void group_int8_gemm(const float* x, long M, long K, const int8_t* q, const float* d, const float* m, float* y,
                     long N, int threads) {
    if (M <= 0) return;
    const long tiles = N / kTile, groups = K / kGroup;
#pragma omp parallel num_threads(threads)
    {
        static thread_local float* panel = nullptr;
        if (M > 2 && panel == nullptr) panel = (float*)aligned_alloc(64, kMaxK * kTile * sizeof(float));
#pragma omp for schedule(static)
        for (long t = 0; t < tiles; t++) {
            const int8_t* qt = q + t * K * kTile;
            const float* dt = d + t * groups * kTile;
            const float* mt = m + t * groups * kTile;
            float* yt = y + t * kTile;
            if (M == 1) { rows_times_tile<1>(x, K, qt, dt, mt, yt, N); continue; }
            if (M == 2) { rows_times_tile<2>(x, K, qt, dt, mt, yt, N); continue; }
            for (long g = 0; g < groups; g++) {
                __m512 d0 = _mm512_loadu_ps(dt + g * 32), d1 = _mm512_loadu_ps(dt + g * 32 + 16);
                __m512 m0 = _mm512_loadu_ps(mt + g * 32), m1 = _mm512_loadu_ps(mt + g * 32 + 16);
                for (long k = g * kGroup; k < (g + 1) * kGroup; k++) {
                    __m512 b0, b1;
                    load_weights(qt + k * 32, d0, d1, m0, m1, &b0, &b1);
                    _mm512_store_ps(panel + k * 32, b0);
                    _mm512_store_ps(panel + k * 32 + 16, b1);
                }
            }
            long r = 0;
            for (; r + 8 <= M; r += 8) rows_times_panel<8>(x + r * K, K, panel, yt + r * N, N);
            rows_tail(M - r, x + r * K, K, panel, yt + r * N, N);
        }
    }
}

// Fills the tiled q/d/m from fp32 w[N, K] and returns 1 when every group has the exact form, else 0.
int group_int8_encode(const float* w, long N, long K, int8_t* q, float* d, float* m, int threads) {
    const long groups = K / kGroup;
    int ok = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        if (!__atomic_load_n(&ok, __ATOMIC_RELAXED)) continue;
        const long t = n / kTile, c = n % kTile;
        for (long g = 0; g < groups; g++) {
            const long at = (t * groups + g) * kTile + c;
            if (!encode_group(w + n * K + g * kGroup, q + (t * K + g * kGroup) * kTile + c, kTile, d + at, m + at)) {
                __atomic_store_n(&ok, 0, __ATOMIC_RELAXED);
                break;
            }
        }
    }
    return ok;
}

}  // extern "C"
