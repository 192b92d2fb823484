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
//   bits 8: q[tile][k / 4][32] uint32, byte j of word c holding column c's q + 128 at
//           k = 4 (k / 4) + j                                     (1.125 bytes per weight), or
//   bits 4: q[tile][k / 8][32] uint32, nibble j (bits 4j..4j+3) of word c holding column c's
//           q at k = 8 (k / 8) + j                                (0.625 bytes per weight; q in 0..15).
// Decode steps stream every weight from memory once, so their time follows these byte counts.
// The 8-bit words are what AVX-512 VNNI's u8 x s8 dot product reads, four k per lane: the
// screened argmax at the end of this file multiplies them by int8 activations.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

using namespace simd;

constexpr long kGroup = 32;
constexpr long kTile = 32;
constexpr long kMaxK = 1 << 14;
// Rows of x per block against a tile's panel: their 2 * rows accumulators stay in registers.
constexpr int kBlockRows = kRegisters == 32 ? 8 : 3;
// Rows per pass of the factored path, which multiplies the stored integers directly
// (rows_times_tile): their 2 * rows group sums stay in registers beside the integers being
// converted, and so do the 2 * rows outputs up to 6 rows; at 7-8 those are kept on the stack
// between groups (a store and a load per 32 inputs), which still beats rebuilding a panel.
// Measured on Zen 4, 2 threads, 8 rows: the 8-bit 49152x576 LM head 2.9 ms against 4.0 ms on a
// panel, a 4-bit 3072x576 gate/up 0.17 against 0.19 ms (576x1536 down 0.11 against 0.10); a
// batch-8 decode step of the embedded default 19.5-21.4 ms against 23.2-25.7.
constexpr long kFactoredRows = kRegisters == 32 ? 8 : 2;
// Up to this many rows take the factored path, in passes of kFactoredRows rows that each convert the
// integers again, and still beat a panel: 30 of the embedded default's 4-bit layers ran 1.19x faster
// at 9-12 rows and 1.02-1.03x at 14-16, 8-bit ones 1.06-1.22x (Zen 4, 2 threads); the AVX2 build
// (run on the same CPU) 1.15-1.58x at 3-4 rows and 1.09-1.25x at 5-16. Past 16 rows a panel's reuse
// wins. Every row's arithmetic is the same whatever its pass, so up to 16 rows a row's output does not
// depend on the rows beside it: a speculative verify step of up to 16 tokens computes what decoding
// them one at a time would.
constexpr long kFactoredMaxRows = 16;

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

// How far ahead of the octet being read its stream is prefetched. A decode step streams every
// weight from memory once, each thread through its tiles in order (contiguous), and with 1-8 rows
// the hardware prefetcher alone left it short of the memory's bandwidth: on Zen 4, 2 threads, 30
// layers of the embedded default's 4-bit weights took 2.78 ms at 1 row against 3.31 (1.19x), 3.89
// against 4.12 at 2 rows and 11.49 against 12.04 at 8, at 2-8 KB ahead alike; the same layers in
// 8 bits 1.12-1.16x faster at 1-8 rows, an 8-bit 49152-row LM head 1.01-1.07x. Cached data: unchanged.
constexpr long kPrefetchBytes = 4096;

// Asks now for the cache lines of the `bytes` that start kPrefetchBytes past p: hints, which never
// fault, so running past the weight's end is harmless (the address is integer arithmetic).
inline void prefetch_ahead(const void* p, long bytes) {
    const uintptr_t start = (uintptr_t)p + kPrefetchBytes;
    for (long i = 0; i < bytes; i += 64) __builtin_prefetch((const void*)(start + i));
}

// Byte B of each lane's word as a signed integer: shifted to the top, then back down sign-extending.
template <int B>
inline vf signed_byte(vi words) {
    if constexpr (B == 3) return to_float(shift_right_arith<24>(words));
    else return to_float(shift_right_arith<24>(shift_left<24 - 8 * B>(words)));
}

template <>
struct TileIntegers<8> {
    const uint32_t* q;
    vi w[4];  // the octet's two words of four k, for columns 0..15 and 16..31, as signed bytes
    explicit TileIntegers(const void* tile) : q((const uint32_t*)tile) {}
    inline void load_octet(long octet) {  // q + 128 back to q: the top bit of every byte flipped
        prefetch_ahead(q + octet * 64, 256);
        for (int i = 0; i < 4; i++) w[i] = xor_int32(load_int32(q + octet * 64 + i * 16), 0x80808080u);
    }
    template <int J>  // k = 8 * octet + J
    inline void get(long, vf* q0, vf* q1) const {
        *q0 = signed_byte<J % 4>(w[2 * (J / 4)]);
        *q1 = signed_byte<J % 4>(w[2 * (J / 4) + 1]);
    }
};

template <>
struct TileIntegers<4> {
    const uint32_t* q;
    vi w0, w1;
    explicit TileIntegers(const void* tile) : q((const uint32_t*)tile) {}
    inline void load_octet(long octet) {
        prefetch_ahead(q + octet * 32, 128);
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
    // add with each x read by the fmas themselves: faster with the few rows of rows_times_tile, slower
    // in rows_times_panel's long blocks (fmadd_broadcast).
    inline void add_broadcast(const float* x, long ldx, long k, vf b0, vf b1) {
        for (int r = 0; r < MR; r++) {
            acc0[r] = fmadd_broadcast(x + r * ldx + k, b0, acc0[r]);
            acc1[r] = fmadd_broadcast(x + r * ldx + k, b1, acc1[r]);
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
        sums.add_broadcast(xs, K, 8 * octet + J, q0, q1);
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

// sums[r, g] = x[r, 32 g] + x[r, 32 g + 1] + ... + x[r, 32 g + 31], added in that order: the factored
// path's offsets, and the screened argmax's exact pass, which must give the same bits.
void group_sums(const float* x, long M, long K, float* sums) {
    const long groups = K / kGroup;
    for (long r = 0; r < M; r++) {
        for (long g = 0; g < groups; g++) {
            float s = 0.0f;
            for (long k = g * kGroup; k < (g + 1) * kGroup; k++) s += x[r * K + k];
            sums[r * groups + g] = s;
        }
    }
}

template <int BITS>
void gemm(const float* x, long M, long K, const void* q, const uint16_t* d, const uint16_t* m, float* y, long N,
          int threads) {
    const long tiles = N / kTile, groups = K / kGroup;
    const long tile_bytes = BITS == 8 ? K * kTile : K / 8 * kTile * 4;
    const bool factored = M <= kFactoredMaxRows;
#pragma omp parallel num_threads(threads)
    {
        static thread_local float* panel = nullptr;
        if (!factored && panel == nullptr) panel = (float*)aligned_alloc(64, kMaxK * kTile * sizeof(float));
        // For the factored path: x's per-group sums and, for the 4-bit layout, x scaled for its nibbles.
        // Each thread makes its own: a few microseconds that would otherwise run before the threads
        // start, and whose output the other thread would then fetch from this core's cache.
        static thread_local std::vector<float> scaled, xsum;
        const float* xs = x;
        if (factored) {
            xsum.resize(M * groups);
            group_sums(x, M, K, xsum.data());
            if (BITS == 4) {
                scaled.resize(M * K);
                for (long r = 0; r < M; r++)
                    for (long k = 0; k < K; k++) scaled[r * K + k] = x[r * K + k] * nibble_unscale(k % 8);
                xs = scaled.data();
            }
        }
#pragma omp for schedule(static)
        for (long t = 0; t < tiles; t++) {
            const void* qt = (const uint8_t*)q + t * tile_bytes;
            const uint16_t* dt = d + t * groups * kTile;
            const uint16_t* mt = m + t * groups * kTile;
            float* yt = y + t * kTile;
            if (factored) {
                for (long r = 0; r < M; r += kFactoredRows)
                    factored_rows<BITS>(std::min(kFactoredRows, M - r), xs + r * K, xsum.data() + r * groups, K, qt,
                                        dt, mt, yt + r * N, N);
                continue;
            }
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
    // Q4_1 stores its offset in fp16: a group whose minimum is no fp16 value is not one (a constant
    // group of a Q8_0 weight would fit it with d = 0, and the weight would be refused as a whole).
    if (fp16_round(lo, 0) == lo) {
        for (int step : steps) {
            const float cand = fp16_round((hi - lo) / 15.0f, step);
            if (fits(w0, w1, cand, lo, 0.0f, 15.0f, q, stride)) { *d = cand; *m = lo; return true; }
        }
    }
    for (int step : steps) {
        const float cand = fp16_round(amax / 127.0f, step);
        if (fits(w0, w1, cand, 0.0f, -127.0f, 127.0f, q, stride)) { *d = cand; *m = 0.0f; return true; }
    }
    return false;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Screened greedy argmax over an 8-bit weight without offsets (m = 0 everywhere: GGUF's Q8_0, as
// the embedded default's LM head is stored).
//
// ids[r] is the first index of the largest of row r's logits as rows_times_tile computes one row,
// found without computing every logit in fp32:
//  1. x is rounded to int8 per group of 32 inputs, each group with its own scale (x~ = s * xq,
//     xq in -127..127), and VNNI's u8 x s8 dot products give every approximate logit
//     a_n = x~ . w_n at about 2.5x the fp32 kernel's speed.
//  2. The exact logit z_n lies within c * |w_n| of a_n: |x . w_n - x~ . w_n| <= |x - x~| |w_n|
//     (Cauchy-Schwarz), and c adds a margin for both sides' fp32 roundings (quantize_rows). So a
//     column whose upper bound a_n + c |w_n| is below L, the largest lower bound a_n - c |w_n|
//     over the row, can neither hold the maximum nor tie with it.
//  3. Only the 32-column tiles with a column reaching L (one to a few per row on real hidden
//     states) are computed exactly, by the one-row kernel, and the first maximum among them is
//     the row's.
// The result is the one-row kernel's argmax whatever the batch: a row's greedy token does not
// depend on which rows share its step.
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
namespace {

constexpr int kScreenRows = 8;  // rows per block: 8 int32 and 8 fp32 accumulators in registers

// x rounded to int8 per group, with what the screen needs beside it.
struct ScreenRows {
    std::vector<int8_t> xq;        // [M][K]
    std::vector<float> scale;      // [M][G]: x~ = scale * xq within the group
    std::vector<int32_t> offset;   // [M][G]: -128 * sum(xq), undoing the stored q + 128
    std::vector<float> bound;      // [M]: c, the bound's factor, rounded up
};

// c = |x - x~| + gamma (|x| + |x~|), with gamma covering the fp32 roundings of the exact one-row
// sums (a tree of depth 32 + G: the group's fma chain, then one fma per group) and of the screen's
// (depth G + 2, each integer sum being exact), and of a_n +- c |w_n| themselves. Norms are summed
// in double; |x - x~| gets 1e-4 of slack for its own and c * |w_n|'s rounding. False when x has a
// value that is not finite (the caller then takes every logit).
bool quantize_rows(const float* x, long M, long K, ScreenRows& s) {
    const long G = K / kGroup;
    s.xq.resize(M * K), s.scale.resize(M * G), s.offset.resize(M * G), s.bound.resize(M);
    const double gamma = (40.0 + 2.0 * G) * 0x1p-24;
    for (long r = 0; r < M; r++) {
        double err2 = 0.0, x2 = 0.0, approx2 = 0.0;
        for (long g = 0; g < G; g++) {
            const float* xg = x + r * K + g * kGroup;
            float amax = 0.0f;
            for (long k = 0; k < kGroup; k++) {
                if (!isfinite(xg[k])) return false;
                amax = fmaxf(amax, fabsf(xg[k]));
            }
            const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (long k = 0; k < kGroup; k++) {
                const int32_t q = (int32_t)fminf(fmaxf(nearbyintf(xg[k] * inverse), -127.0f), 127.0f);
                s.xq[r * K + g * kGroup + k] = (int8_t)q;
                sum += q;
                const double approx = (double)scale * q, err = (double)xg[k] - approx;
                err2 += err * err, x2 += (double)xg[k] * xg[k], approx2 += approx * approx;
            }
            s.scale[r * G + g] = scale;
            s.offset[r * G + g] = -128 * sum;
        }
        const double c = 1.0001 * sqrt(err2) + gamma * (sqrt(x2) + sqrt(approx2)) + 1e-30;
        if (!isfinite(c)) return false;
        s.bound[r] = nextafterf((float)c, INFINITY);
    }
    return true;
}

// MR rows against 16 columns (one half of a tile): hi[r] = the largest upper bound among them, and
// lo[r * 16 ..] = the lane-wise largest lower bound so far.
template <int MR>
void screen_rows(const ScreenRows& s, long row, long K, const uint8_t* q, const uint16_t* d, const float* norms,
                 float* hi, long ldhi, float* lo) {
    const long G = K / kGroup;
    const int8_t* xq = s.xq.data() + row * K;
    __m512 out[MR];
    for (int r = 0; r < MR; r++) out[r] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        __m512i acc[MR];
        for (int r = 0; r < MR; r++) acc[r] = _mm512_set1_epi32(s.offset[(row + r) * G + g]);
        for (int i = 0; i < kGroup / 4; i++) {
            const __m512i w = _mm512_loadu_si512(q + (g * kGroup / 4 + i) * 128);  // 16 columns' four k
            for (int r = 0; r < MR; r++) {
                int32_t four;
                memcpy(&four, xq + r * K + g * kGroup + 4 * i, 4);
                acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(four));
            }
        }
        const __m512 dg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + g * kTile)));
        for (int r = 0; r < MR; r++) {
            const __m512 ds = _mm512_mul_ps(dg, _mm512_set1_ps(s.scale[(row + r) * G + g]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), ds, out[r]);
        }
    }
    const __m512 wn = _mm512_loadu_ps(norms);
    for (int r = 0; r < MR; r++) {
        const __m512 c = _mm512_mul_ps(_mm512_set1_ps(s.bound[row + r]), wn);
        hi[r * ldhi] = _mm512_reduce_max_ps(_mm512_add_ps(out[r], c));
        float* lr = lo + (row + r) * 16;
        _mm512_storeu_ps(lr, _mm512_max_ps(_mm512_loadu_ps(lr), _mm512_sub_ps(out[r], c)));
    }
}

template <int MR = 1>
inline void screen_tail(long rows, const ScreenRows& s, long row, long K, const uint8_t* q, const uint16_t* d,
                        const float* norms, float* hi, long ldhi, float* lo) {
    if constexpr (MR < kScreenRows) {
        if (rows == MR) screen_rows<MR>(s, row, K, q, d, norms, hi, ldhi, lo);
        else screen_tail<MR + 1>(rows, s, row, K, q, d, norms, hi, ldhi, lo);
    }
}

int screened_argmax(const float* x, long M, long K, const void* q, const uint16_t* d, const uint16_t* m,
                    const float* norms, long N, int64_t* ids, int threads) {
    const long tiles = N / kTile, halves = 2 * tiles, groups = K / kGroup;
    ScreenRows s;
    if (!quantize_rows(x, M, K, s)) return 0;
    std::vector<float> hi(M * halves), floor(M, -INFINITY);
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> lo(M * 16, -INFINITY);  // each row's 16 lanes
#pragma omp for schedule(static)
        for (long h = 0; h < halves; h++) {  // half h / 2 of tile h / 2: its words' 64 bytes at h % 2 * 64
            const uint8_t* qh = (const uint8_t*)q + (h / 2) * K * kTile + (h % 2) * 64;
            const uint16_t* dh = d + (h / 2) * groups * kTile + (h % 2) * 16;
            long r = 0;
            for (; r + kScreenRows <= M; r += kScreenRows)
                screen_rows<kScreenRows>(s, r, K, qh, dh, norms + h * 16, hi.data() + r * halves + h, halves, lo.data());
            screen_tail(M - r, s, r, K, qh, dh, norms + h * 16, hi.data() + r * halves + h, halves, lo.data());
        }
#pragma omp critical
        for (long r = 0; r < M; r++) floor[r] = fmaxf(floor[r], _mm512_reduce_max_ps(_mm512_loadu_ps(lo.data() + r * 16)));
    }
    std::vector<float> xsum(M * groups);  // as gemm's factored path sums them
    group_sums(x, M, K, xsum.data());
    int ok = 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long r = 0; r < M; r++) {
        const float* xr = x + r * K;
        float best = -INFINITY;
        long best_id = -1;
        alignas(64) float y[kTile];
        for (long t = 0; t < tiles && best_id != -2; t++) {
            if (hi[r * halves + 2 * t] < floor[r] && hi[r * halves + 2 * t + 1] < floor[r]) continue;
            rows_times_tile<1, 8>(xr, xsum.data() + r * groups, K, (const uint8_t*)q + t * K * kTile,
                                  d + t * groups * kTile, m + t * groups * kTile, y, kTile);
            for (long c = 0; c < kTile; c++) {
                if (isnan(y[c])) { best_id = -2; break; }
                if (y[c] > best || best_id == -1) best = y[c], best_id = t * kTile + c;
            }
        }
        if (best_id < 0) __atomic_store_n(&ok, 0, __ATOMIC_RELAXED);
        ids[r] = best_id;
    }
    return ok;
}

}  // namespace
#endif

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

// Whether this build has the screened argmax (AVX-512 with VNNI).
int group_int8_argmax_available() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

// ids[M] = the first argmax of each row of x[M, K] @ w^T, for an 8-bit tiled weight with m = 0 and
// norms[N] its rows' L2 norms rounded up (see screened_argmax). 0 where it cannot answer (x or a
// logit not finite, or no VNNI in this build): the caller then takes every logit.
int group_int8_argmax(const float* x, long M, long K, const void* q, const uint16_t* d, const uint16_t* m,
                      const float* norms, long N, int64_t* ids, int threads) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    return M > 0 ? screened_argmax(x, M, K, q, d, m, norms, N, ids, threads) : 1;
#else
    (void)x, (void)M, (void)K, (void)q, (void)d, (void)m, (void)norms, (void)N, (void)ids, (void)threads;
    return 0;
#endif
}

}  // extern "C"
