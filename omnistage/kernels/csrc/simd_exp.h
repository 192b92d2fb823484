// e^x on 16 fp32 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial
// (truncation below 0.1 ulp), then scaled by 2^n. Inputs are clamped to [-104, 89]: below, the result
// is 0; above, +inf.
#pragma once
#include "simd.h"

static inline simd::vf exp_ps(simd::vf x) {
    using namespace simd;
    x = min(max(x, set1(-104.0f)), set1(89.0f));
    vf n = round(mul(x, set1(1.44269504088896341f)));
    vf r = fnmadd(n, set1(0.693145751953125f), x);  // ln2 in two parts: exact n * hi
    r = fnmadd(n, set1(1.428606765330187e-06f), r);
    vf p = set1(1.0f / 5040.0f);
    p = fmadd(p, r, set1(1.0f / 720.0f));
    p = fmadd(p, r, set1(1.0f / 120.0f));
    p = fmadd(p, r, set1(1.0f / 24.0f));
    p = fmadd(p, r, set1(1.0f / 6.0f));
    p = fmadd(p, r, set1(0.5f));
    p = fmadd(p, r, set1(1.0f));
    p = fmadd(p, r, set1(1.0f));
    return scale_by_pow2(p, n);
}
