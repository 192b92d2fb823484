// Group-int8 weights: w[n, k] = fma(d[n, g], q[n, k], m[n, g]) with g = k / 32, q small integers.
//
// This is how GGUF's Q4_1 (q in 0..15, m = the group's minimum) and Q8_0
// (q in -127..127, m = 0) blocks dequantize to fp32, so a checkpoint loaded
// from such a file has this form exactly. group_int8_encode recovers it from
// the fp32 weights (and refuses unless every weight is reproduced bit for
// bit); group_int8_gemm multiplies fp32 activations by it: equal to a plain
// fp32 matmul on those weights in exact arithmetic, with roundings of the size
// a different summation order gives.
//
// Layout, tiled by 32 output columns; d/m[tile][g][32] fp16 (as GGUF stores them), and q either
//   bits 8: q[tile][k][32] int8                                   (1.125 bytes per weight), or
//   bits 4: q[tile][k / 8][32] uint32, nibble j (bits 4j..4j+3) of word c holding column c's
//           q at k = 8 (k / 8) + j                                (0.625 bytes per weight; q in 0..15).
// Decode steps stream every weight from memory once, so their time follows these byte counts.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <vector>

#include "simd.h"

namespace {

using namespace simd;

constexpr long kGroup = 32;
constexpr long kTile = 32;
constexpr long kMaxK = 1 << 14;
// Rows of x per block against a tile's panel: their 2 * rows accumulators stay in registers.
constexpr int kBlockRows = kRegisters == 32 ? 8 : 3;
// Up to this many rows multiply the stored integers directly (rows_times_tile): their 2 * rows
// group sums stay in registers beside the integers being converted, and so do the 2 * rows
// outputs up to 6 rows; at 7-8 those are kept on the stack between groups (a store and a load
// per 32 inputs), which still beats rebuilding a panel. Measured on Zen 4, 2 threads, 8 rows:
// the 8-bit 49152x576 LM head 2.9 ms against 4.0 ms on a panel, a 4-bit 3072x576 gate/up
// 0.17 against 0.19 ms (576x1536 down 0.11 against 0.10); a batch-8 decode step of the
// embedded default 19.5-21.4 ms against 23.2-25.7. Past 8 rows panels win on 4-bit weights.
constexpr int kFactoredRows = kRegisters == 32 ? 8 : 2;

// Nibble j of each lane's word, times 16^j: masked in place, never shifted (one op per k), except
// the top one, shifted down (a mask would leave the sign bit set). Exact as an fp32: 4 significant bits.
template <int J>
inline vf nibble_scaled(vi words) {
    if constexpr (J == 7) return to_float(shift_right<28>(words));
    else return to_float(and_int32(words, 15u << (4 * J)));
}
// What nibble_scaled<J> must be multiplied by to give q: 16^-j (1 for the top nibble).
constexpr float nibble_unscale(int j) { return j == 7 ? 1.0f : 1.0f / (float)(1u << (4 * j)); }

// One k's 32 integers of a tile as fp32, exactly; for bits 4, nibble_unscale(k % 8) times them.
template <int BITS>
struct TileIntegers;

template <>
struct TileIntegers<8> {
    const int8_t* q;
    explicit TileIntegers(const void* tile) : q((const int8_t*)tile) {}
    template <int J>  // k = 8 * octet + J
    inline void get(long octet, vf* q0, vf* q1) const {
        const int8_t* row = q + (8 * octet + J) * 32;
        *q0 = from_int8(row);
        *q1 = from_int8(row + 16);
    }
    inline void load_octet(long) {}
};

template <>
struct TileIntegers<4> {
    const uint32_t* q;
    vi w0, w1;
    explicit TileIntegers(const void* tile) : q((const uint32_t*)tile) {}
    inline void load_octet(long octet) {
        w0 = load_int32(q + octet * 32);
        w1 = load_int32(q + octet * 32 + 16);
    }
    template <int J>
    inline void get(long, vf* q0, vf* q1) const {
        *q0 = nibble_scaled<J>(w0);
        *q1 = nibble_scaled<J>(w1);
    }
};

// Calls f.template at<J>(octet) for J = 0..7: the eight k of one octet, unrolled.
template <int J = 0, typename F>
inline void for_octet(long octet, F& f) {
    if constexpr (J < 8) {
        f.template at<J>(octet);
        for_octet<J + 1>(octet, f);
    }
}

// MR rows' accumulators for one tile's 32 output columns.
template <int MR>
struct RowBlock {
    vf acc0[MR], acc1[MR];

    RowBlock() {
        for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = zero();
    }
    // Adds x[r, k] times the tile's 32 values at k (b0, b1) to every row r.
    inline void add(const float* x, long ldx, long k, vf b0, vf b1) {
        for (int r = 0; r < MR; r++) {
            const vf a = set1(x[r * ldx + k]);
            acc0[r] = fmadd(a, b0, acc0[r]);
            acc1[r] = fmadd(a, b1, acc1[r]);
        }
    }
    inline void store_rows(float* y, long ldy) const {
        for (int r = 0; r < MR; r++) {
            store(y + r * ldy, acc0[r]);
            store(y + r * ldy + 16, acc1[r]);
        }
    }
};

// MR rows of x times a tile's weights already rebuilt into panel[K][32] (several row blocks reuse it).
template <int MR>
void rows_times_panel(const float* x, long K, const float* panel, float* y, long ldy) {
    RowBlock<MR> rows;
    for (long k = 0; k < K; k++) rows.add(x, K, k, load_aligned(panel + k * 32), load_aligned(panel + k * 32 + 16));
    rows.store_rows(y, ldy);
}

// One group's sums of q * x for MR rows: xs holds x already multiplied by nibble_unscale (bits 4),
// so q * 16^j * x * 16^-j = q * x exactly (an fma's product is exact; only underflow of x * 16^-j,
// for |x| < 2^-98, could differ).
template <int MR, int BITS>
struct GroupSums {
    const float* xs;
    long K;
    TileIntegers<BITS>& ints;
    RowBlock<MR> sums;
    template <int J>
    inline void at(long octet) {
        vf q0, q1;
        ints.template get<J>(octet, &q0, &q1);
        sums.add(xs, K, 8 * octet + J, q0, q1);
    }
};

// MR (up to kFactoredRows) rows straight from the stored integers, each converted once for all
// of them: with so few rows a rebuilt panel's stores and loads would cost more than they save.
// Each group's scale and offset come out of its sum, y += d * sum(q * x) + m * sum(x) (xsum[r, g]
// holds sum(x) per row and group): one fma per weight and row, and no weight is rebuilt.
template <int MR, int BITS>
void rows_times_tile(const float* xs, const float* xsum, long K, const void* q, const uint16_t* d, const uint16_t* m,
                     float* y, long ldy) {
    const long groups = K / kGroup;
    TileIntegers<BITS> ints(q);
    RowBlock<MR> out;
    for (long g = 0; g < groups; g++) {
        GroupSums<MR, BITS> group{xs, K, ints, {}};
        for (long octet = g * kGroup / 8; octet < (g + 1) * kGroup / 8; octet++) {
            ints.load_octet(octet);
            for_octet(octet, group);
        }
        const vf d0 = from_fp16(d + g * 32), d1 = from_fp16(d + g * 32 + 16);
        const vf m0 = from_fp16(m + g * 32), m1 = from_fp16(m + g * 32 + 16);
        for (int r = 0; r < MR; r++) {
            const vf sx = set1(xsum[r * groups + g]);
            out.acc0[r] = fmadd(m0, sx, fmadd(d0, group.sums.acc0[r], out.acc0[r]));
            out.acc1[r] = fmadd(m1, sx, fmadd(d1, group.sums.acc1[r], out.acc1[r]));
        }
    }
    out.store_rows(y, ldy);
}

// rows_times_tile for rows = 1 .. kFactoredRows.
template <int BITS, int MR = 1>
inline void factored_rows(long rows, const float* xs, const float* xsum, long K, const void* q, const uint16_t* d,
                          const uint16_t* m, float* y, long ldy) {
    if constexpr (MR <= kFactoredRows) {
        if (rows == MR) rows_times_tile<MR, BITS>(xs, xsum, K, q, d, m, y, ldy);
        else factored_rows<BITS, MR + 1>(rows, xs, xsum, K, q, d, m, y, ldy);
    }
}

// A tile's weights rebuilt exactly into panel[K][32] fp32, for several row blocks to reuse: d * q is
// exact in fp32 (11-bit d, q of at most 8 bits), so fma(d, q, m) rounds once, like GGUF's d * q + m.
template <int BITS>
struct PanelBuilder {
    TileIntegers<BITS>& ints;
    vf d0, d1, m0, m1;
    float* panel;
    template <int J>
    inline void at(long octet) {
        vf q0, q1;
        ints.template get<J>(octet, &q0, &q1);
        if constexpr (BITS == 4 && J < 7) {  // back to q: a power of two, exact
            q0 = mul(q0, set1(nibble_unscale(J)));
            q1 = mul(q1, set1(nibble_unscale(J)));
        }
        const long k = 8 * octet + J;
        store_aligned(panel + k * 32, fmadd(d0, q0, m0));
        store_aligned(panel + k * 32 + 16, fmadd(d1, q1, m1));
    }
};

template <int BITS>
void build_panel(long K, const void* q, const uint16_t* d, const uint16_t* m, float* panel) {
    TileIntegers<BITS> ints(q);
    for (long g = 0; g < K / kGroup; g++) {
        PanelBuilder<BITS> b{ints, from_fp16(d + g * 32), from_fp16(d + g * 32 + 16), from_fp16(m + g * 32),
                             from_fp16(m + g * 32 + 16), panel};
        for (long octet = g * kGroup / 8; octet < (g + 1) * kGroup / 8; octet++) {
            ints.load_octet(octet);
            for_octet(octet, b);
        }
    }
}

// The last rows, fewer than a block.
template <int MR>
inline void panel_rows_below_block(const float* x, long K, const float* panel, float* y, long ldy) {
    if constexpr (MR < kBlockRows) rows_times_panel<MR>(x, K, panel, y, ldy);
}

void rows_tail(long rows, const float* x, long K, const float* panel, float* y, long ldy) {
    switch (rows) {
        case 7: panel_rows_below_block<7>(x, K, panel, y, ldy); break;
        case 6: panel_rows_below_block<6>(x, K, panel, y, ldy); break;
        case 5: panel_rows_below_block<5>(x, K, panel, y, ldy); break;
        case 4: panel_rows_below_block<4>(x, K, panel, y, ldy); break;
        case 3: panel_rows_below_block<3>(x, K, panel, y, ldy); break;
        case 2: panel_rows_below_block<2>(x, K, panel, y, ldy); break;
        case 1: panel_rows_below_block<1>(x, K, panel, y, ldy); break;
        default: break;
    }
}

template <int BITS>
void gemm(const float* x, long M, long K, const void* q, const uint16_t* d, const uint16_t* m, float* y, long N,
          int threads) {
    const long tiles = N / kTile, groups = K / kGroup;
    const long tile_bytes = BITS == 8 ? K * kTile : K / 8 * kTile * 4;
    // For the factored path: x's per-group sums and, for the 4-bit layout, x scaled for its nibbles.
    const bool factored = M <= kFactoredRows;
    std::vector<float> scaled, xsum;
    const float* xs = x;
    if (factored) {
        xsum.resize(M * groups);
        if (BITS == 4) {
            scaled.resize(M * K);
            for (long i = 0; i < M * K; i++) scaled[i] = x[i] * nibble_unscale(i % K % 8);
            xs = scaled.data();
        }
        for (long r = 0; r < M; r++) {
            for (long g = 0; g < groups; g++) {
                float s = 0.0f;
                for (long k = g * kGroup; k < (g + 1) * kGroup; k++) s += x[r * K + k];
                xsum[r * groups + g] = s;
            }
        }
    }
#pragma omp parallel num_threads(threads)
    {
        static thread_local float* panel = nullptr;
        if (!factored && panel == nullptr) panel = (float*)aligned_alloc(64, kMaxK * kTile * sizeof(float));
#pragma omp for schedule(static)
        for (long t = 0; t < tiles; t++) {
            const void* qt = (const uint8_t*)q + t * tile_bytes;
            const uint16_t* dt = d + t * groups * kTile;
            const uint16_t* mt = m + t * groups * kTile;
            float* yt = y + t * kTile;
            if (factored) { factored_rows<BITS>(M, xs, xsum.data(), K, qt, dt, mt, yt, N); continue; }
            build_panel<BITS>(K, qt, dt, mt, panel);
            long r = 0;
            for (; r + kBlockRows <= M; r += kBlockRows) rows_times_panel<kBlockRows>(x + r * K, K, panel, yt + r * N, N);
            rows_tail(M - r, x + r * K, K, panel, yt + r * N, N);
        }
    }
}

inline float fp16_round(float x, int step) {
    uint16_t h = (uint16_t)(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT) + step);
    return _cvtsh_ss(h);
}

// Whether all 32 weights w == fma(d, q, m) for integers q in [lo, hi]; those q go to q_out[i * stride].
bool fits(vf w0, vf w1, float d, float m, float lo, float hi, int8_t* q_out, long stride) {
    const vf dv = set1(d), mv = set1(m);
    const vf lov = set1(lo), hiv = set1(hi);
    vf q[2];
    const vf w[2] = {w0, w1};
    for (int h = 0; h < 2; h++) {
        q[h] = d == 0.0f ? zero() : round(div(sub(w[h], mv), dv));
        const unsigned ok = ge(q[h], lov) & le(q[h], hiv) & eq(fmadd(dv, q[h], mv), w[h]);
        if (ok != 0xFFFF) return false;
    }
    alignas(64) int32_t qi[32];
    store_int32(qi, q[0]);
    store_int32(qi + 16, q[1]);
    for (long i = 0; i < kGroup; i++) q_out[i * stride] = (int8_t)qi[i];
    return true;
}

// One group of 32 weights: the Q4_1 layout first, then Q8_0's; d is an fp16 value near its estimate.
bool encode_group(const float* w, int8_t* q, long stride, float* d, float* m) {
    const vf w0 = load(w), w1 = load(w + 16);
    const float lo = reduce_min(min(w0, w1));
    const float hi = reduce_max(max(w0, w1));
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

// y[M, N] = x[M, K] @ w^T for the tiled group weight w (N, K multiples of 32, K <= kMaxK), q of `bits` 8 or 4.
void group_int8_gemm(const float* x, long M, long K, const void* q, int bits, const uint16_t* d, const uint16_t* m,
                     float* y, long N, int threads) {
    if (M <= 0) return;
    if (bits == 4) gemm<4>(x, M, K, q, d, m, y, N, threads);
    else gemm<8>(x, M, K, q, d, m, y, N, threads);
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
