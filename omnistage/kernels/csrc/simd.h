// 16 fp32 lanes, the kernels' one vector type: one zmm register where the compiler targets
// AVX-512 (-march=native on such a CPU), two ymm registers on AVX2 + FMA + F16C otherwise.
//
// The kernels are written once against these functions. On AVX-512 each is the single
// intrinsic the kernels called before this header existed; on AVX2 each does the same
// per-lane arithmetic on two halves, reductions in the same order, so both builds give
// the same bits.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace simd {

#if defined(__AVX512F__)

constexpr int kRegisters = 32;  // vector registers: sets how many rows a matmul block can hold
using vf = __m512;
using tail = __mmask16;  // the live lanes of a partial vector

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float a) { return _mm512_set1_ps(a); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load_aligned(const float* p) { return _mm512_load_ps(p); }  // p 64-byte aligned
inline void store(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline void store_aligned(float* p, vf a) { _mm512_store_ps(p, a); }
inline tail first(long n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
inline vf load(const float* p, tail t) { return _mm512_maskz_loadu_ps(t, p); }  // dead lanes read as 0
inline void store(float* p, tail t, vf a) { _mm512_mask_storeu_ps(p, t, a); }
inline vf keep(tail t, vf a) { return _mm512_maskz_mov_ps(t, a); }  // dead lanes set to 0
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
// *a * b + c, one rounding, *a read by the fma itself ({1to16}): the load unit broadcasts it, where
// the compiler's own choice, one vbroadcastss shared by the fmas that use it, takes a vector pipe the
// fmas could have used (a 2-row matmul of 4-bit weights 1.16-1.20x faster on Zen 4). The asm is why
// only loops of few rows should use it: it stops the compiler from scheduling the fmas itself.
inline vf fmadd_broadcast(const float* a, vf b, vf c) {
    asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(c) : "v"(b), "m"(*a));
    return c;
}
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline vf round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
inline vf scale_by_pow2(vf a, vf n) { return _mm512_scalef_ps(a, n); }  // a * 2^n, n integral
inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
// Lane i: reduce_add(v[i]), for 16 vectors at once. Each sum is made of the very additions
// reduce_add makes (GCC's order: lanes l and l + 8, then l and l + 4, l and l + 2, l and l + 1;
// x + y and y + x are the same bits), so the same bits, in 15 vector additions instead of 16
// horizontal sums: each level adds the halves of two vectors' partial sums side by side.
inline vf reduce_add16(const vf* v) {
    vf half[8], quarter[4], eighth[2];
    for (int p = 0; p < 8; p++)  // [a's 8 lane sums, b's]
        half[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int p = 0; p < 4; p++)  // one 128-bit block of 4 lane sums per vector: keys 4p .. 4p + 3
        quarter[p] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * p], half[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(half[2 * p], half[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int p = 0; p < 2; p++)  // block b: [key b's 2 sums, key 4 + b's] (keys 8 on for p = 1)
        eighth[p] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * p], quarter[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(quarter[2 * p], quarter[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // Block b: the sums of keys b, 4 + b, 8 + b, 12 + b; put back in key order.
    const vf sums = _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}
inline float reduce_min(vf a) { return _mm512_reduce_min_ps(a); }
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
// Lane-wise comparisons as 16-bit masks (bit i for lane i).
inline unsigned ge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline unsigned le(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline unsigned eq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline void store_int32(int32_t* p, vf a) {  // a's lanes rounded to integers (p 64-byte aligned)
    _mm512_store_si512((__m512i*)p, _mm512_cvtps_epi32(a));
}
inline vf from_fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
// 16 int32 lanes, for unpacking integers packed into words.
using vi = __m512i;
inline vi load_int32(const uint32_t* p) { return _mm512_loadu_si512((const void*)p); }
inline vi and_int32(vi a, uint32_t mask) { return _mm512_and_si512(a, _mm512_set1_epi32((int)mask)); }
inline vi xor_int32(vi a, uint32_t mask) { return _mm512_xor_si512(a, _mm512_set1_epi32((int)mask)); }
template <int N>
inline vi shift_right(vi a) { return _mm512_srli_epi32(a, N); }  // logical
template <int N>
inline vi shift_right_arith(vi a) { return _mm512_srai_epi32(a, N); }  // sign-extending
template <int N>
inline vi shift_left(vi a) { return _mm512_slli_epi32(a, N); }
inline vf to_float(vi a) { return _mm512_cvtepi32_ps(a); }      // signed int32 lanes

#else  // AVX2 + FMA + F16C

constexpr int kRegisters = 8;  // 16 ymm registers hold 8 vf
struct vf {
    __m256 lo, hi;
};
struct tail {
    __m256i lo, hi;  // all-ones in live lanes
};

inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline vf load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf load_aligned(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline void store(float* p, vf a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline void store_aligned(float* p, vf a) { _mm256_store_ps(p, a.lo), _mm256_store_ps(p + 8, a.hi); }
inline tail first(long n) {
    const __m256i live = _mm256_set1_epi32(n >= 16 ? 16 : (int)n);
    return {_mm256_cmpgt_epi32(live, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
            _mm256_cmpgt_epi32(live, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline vf load(const float* p, tail t) { return {_mm256_maskload_ps(p, t.lo), _mm256_maskload_ps(p + 8, t.hi)}; }
inline void store(float* p, tail t, vf a) { _mm256_maskstore_ps(p, t.lo, a.lo), _mm256_maskstore_ps(p + 8, t.hi, a.hi); }
inline vf keep(tail t, vf a) {
    return {_mm256_and_ps(_mm256_castsi256_ps(t.lo), a.lo), _mm256_and_ps(_mm256_castsi256_ps(t.hi), a.hi)};
}
inline vf add(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf div(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf min(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf max(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf fmadd_broadcast(const float* a, vf b, vf c) { return fmadd(set1(*a), b, c); }
inline vf fnmadd(vf a, vf b, vf c) {
    return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf round(vf a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// a * 2^n as AVX-512's scalef rounds it, for integral n in [-252, 254] and a within a few binades
// of 1 (as exp_ps has): two power-of-two factors, each a normal float, the first product exact,
// so only the second rounds, once, as scalef's single product does.
inline __m256 scale_by_pow2(__m256 a, __m256 n) {
    const __m256i e = _mm256_cvtps_epi32(n), e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(a, f1), f2);
}
inline vf scale_by_pow2(vf a, vf n) { return {scale_by_pow2(a.lo, n.lo), scale_by_pow2(a.hi, n.hi)}; }
// Folds the 16 lanes with op: lo with hi, then halves of that, then pairs, the order of GCC's
// _mm512_reduce_*_ps. Op has an __m256 and an __m128 overload.
template <typename Op>
inline float reduce(vf a, Op op) {
    const __m256 s = op(a.lo, a.hi);
    __m128 h = op(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = op(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(op(h, _mm_movehdup_ps(h)));
}
struct Add {
    __m256 operator()(__m256 a, __m256 b) const { return _mm256_add_ps(a, b); }
    __m128 operator()(__m128 a, __m128 b) const { return _mm_add_ps(a, b); }
};
struct Min {
    __m256 operator()(__m256 a, __m256 b) const { return _mm256_min_ps(a, b); }
    __m128 operator()(__m128 a, __m128 b) const { return _mm_min_ps(a, b); }
};
struct Max {
    __m256 operator()(__m256 a, __m256 b) const { return _mm256_max_ps(a, b); }
    __m128 operator()(__m128 a, __m128 b) const { return _mm_max_ps(a, b); }
};
inline float reduce_add(vf a) { return reduce(a, Add{}); }
// Lane i: reduce_add(v[i]) (AVX-512's version batches the same additions).
inline vf reduce_add16(const vf* v) {
    alignas(64) float sums[16];
    for (int i = 0; i < 16; i++) sums[i] = reduce_add(v[i]);
    return load_aligned(sums);
}
inline float reduce_min(vf a) { return reduce(a, Min{}); }
inline float reduce_max(vf a) { return reduce(a, Max{}); }
// Lane-wise comparison with predicate P as a 16-bit mask (bit i for lane i).
template <int P>
inline unsigned compare(vf a, vf b) {
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, P)) |
           ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, P)) << 8);
}
inline unsigned ge(vf a, vf b) { return compare<_CMP_GE_OQ>(a, b); }
inline unsigned le(vf a, vf b) { return compare<_CMP_LE_OQ>(a, b); }
inline unsigned eq(vf a, vf b) { return compare<_CMP_EQ_OQ>(a, b); }
inline void store_int32(int32_t* p, vf a) {
    _mm256_store_si256((__m256i*)p, _mm256_cvtps_epi32(a.lo));
    _mm256_store_si256((__m256i*)(p + 8), _mm256_cvtps_epi32(a.hi));
}
inline vf from_fp16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
struct vi {
    __m256i lo, hi;
};
inline vi load_int32(const uint32_t* p) {
    return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 8))};
}
inline vi and_int32(vi a, uint32_t mask) {
    const __m256i m = _mm256_set1_epi32((int)mask);
    return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
inline vi xor_int32(vi a, uint32_t mask) {
    const __m256i m = _mm256_set1_epi32((int)mask);
    return {_mm256_xor_si256(a.lo, m), _mm256_xor_si256(a.hi, m)};
}
template <int N>
inline vi shift_right(vi a) { return {_mm256_srli_epi32(a.lo, N), _mm256_srli_epi32(a.hi, N)}; }
template <int N>
inline vi shift_right_arith(vi a) { return {_mm256_srai_epi32(a.lo, N), _mm256_srai_epi32(a.hi, N)}; }
template <int N>
inline vi shift_left(vi a) { return {_mm256_slli_epi32(a.lo, N), _mm256_slli_epi32(a.hi, N)}; }
inline vf to_float(vi a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }

#endif

}  // namespace simd
