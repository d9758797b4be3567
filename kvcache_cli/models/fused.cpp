// A decode step's small ops, each one pass over a few rows, on the CPU.
//
// Built at first use by `models/fused.py` (through `caches/native.py`), called through
// ctypes. A decode step of SmolLM2 (30 layers of 576) or Gemma 3 (18 layers, QK-norm, four
// norms a layer) is a few large products among thousands of small torch ops: each norm
// five to eight of them, the rotation six, the gated activation three, each a few
// microseconds of dispatch for a few hundred numbers. Each function below does in one pass
// what those ops did. The norms do llama.cpp's CPU arithmetic (ggml's rms_norm, then its mul
// by the gain, then its add), so that where a product rounds its row to 8 bits as llama.cpp's
// does (`gguf-q8`, `q8_0`) the rounded integers are llama.cpp's too: the row's squares summed
// in double, their mean rounded to float, 1 / sqrt(mean + eps) in float (two roundings), the
// row times that, then times the gain, then the residual added, each product rounded to
// float. The rest equals torch's ops to float32 rounding.
// Plain loops the compiler vectorises (-O3 -march=native), one thread: a decode's rows are
// too few to share.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// v as computed: the compiler may not rewrite across this point. Under -ffast-math it may
// narrow the double steps below to float ones and make 1.0f / sqrtf an approximate
// reciprocal root (clang does), which is not ggml's rounding.
template <class T>
inline T kept(T v) {
    asm volatile("" : "+m"(v));
    return v;
}

// 1 / sqrt(mean of squares + eps) of one row of n floats, RMSNorm's factor, as ggml's
// rms_norm: each square rounded to float, summed in double (in lanes here, serially there:
// a double sum of floats is exact enough that the float mean rounds alike), the mean
// rounded to float, then sqrtf and 1.0f / it, each correctly rounded (float's sqrt and
// quotient equal double's rounded to float).
inline float inv_rms(const float* x, int64_t n, float eps) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i] * x[i]);
    const float mean = kept(static_cast<float>(s / static_cast<double>(n)));
    const float root = kept(static_cast<float>(std::sqrt(static_cast<double>(mean + eps))));
    return kept(static_cast<float>(1.0 / static_cast<double>(root)));
}

// y = (x * r) * (offset + w): a normed row times its gain, ggml's two products in its order
// (offset 1: Gemma's 1 + w, w read as the GGUF's stored gain less 1, so 1 + w is the stored
// gain again wherever that subtraction was exact: a gain of at least 0.5, and every gain of
// the real 270M file). Two passes, as ggml's two ops: in one, fast math reassociates
// x * r * g as x * (r * g) (GCC 12 does).
inline void scaled(const float* x, float r, const float* w, float offset, float* y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] *= offset + w[i];
}

#include "../caches/fast_exp.h"

// e^x with x clamped to [-87.3, 88] (below: float's smallest normal; above: finite).
inline float exp_clamped(float x) {
    return exp_in_range(x < -87.3f ? -87.3f : (x > 88.f ? 88.f : x));
}

}  // namespace

extern "C" {

// y (R, C) = RMSNorm of x (R, C) with gain offset + w (C,).
void rms_norm(const float* x, const float* w, float offset, float eps, float* y, int64_t R,
              int64_t C) {
    for (int64_t r = 0; r < R; ++r) scaled(x + r * C, inv_rms(x + r * C, C, eps), w, offset,
                                           y + r * C, C);
}

// The residual add and the norm after it, each row once: sum = x + d, where d is delta or,
// given dw, delta normed with gain offset + dw (Gemma's norm after each sublayer); then,
// given w, y = sum normed with gain offset + w (the next sublayer's input).
void add_rms_norm(const float* x, const float* delta, const float* dw, const float* w,
                  float offset, float eps, float* sum, float* y, int64_t R, int64_t C) {
    for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + r * C;
        const float* dr = delta + r * C;
        float* sr = sum + r * C;
        if (dw) {
            // normed into sum, then added: in one pass fast math may fuse the last product
            // and the add into one rounding, which ggml's separate ops do not
            scaled(dr, inv_rms(dr, C, eps), dw, offset, sr, C);
#pragma omp simd
            for (int64_t i = 0; i < C; ++i) sr[i] += xr[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < C; ++i) sr[i] = xr[i] + dr[i];
        }
        if (w) scaled(sr, inv_rms(sr, C, eps), w, offset, y + r * C, C);
    }
}

// In place on the rows of one fused q|k|v product (R rows of `heads` heads of hs): the first
// nq heads (q) and the next nk (k) each normed first where qw / kw are given (QK-norm, gain
// offset + w), then rotated to their row's position (transformers' rotate_half layout:
// the pair (i, i + hs/2) turned by the angle in row p of the cos and sin tables (ctx, hs)),
// q then scaled by q_scale; v untouched. Row r's position is pos[r % npos]: pos is (T,) for
// every sequence or (B, T), one per row.
void qk_rotary(float* qkv, int64_t R, int64_t heads, int64_t nq, int64_t nk, int64_t hs,
               const float* qw, const float* kw, float offset, float eps, const float* cos,
               const float* sin, const int64_t* pos, int64_t npos, float q_scale) {
    const int64_t half = hs / 2;
    for (int64_t r = 0; r < R; ++r) {
        const float* c = cos + pos[r % npos] * hs;
        const float* s = sin + pos[r % npos] * hs;
        for (int64_t h = 0; h < nq + nk; ++h) {
            float* x = qkv + (r * heads + h) * hs;
            const float* w = h < nq ? qw : kw;
            if (w) scaled(x, inv_rms(x, hs, eps), w, offset, x, hs);
            const float scale = h < nq ? q_scale : 1.f;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = x[i], b = x[i + half];
                x[i] = (a * c[i] - b * s[i]) * scale;
                x[i + half] = (b * c[i + half] + a * s[i + half]) * scale;
            }
        }
    }
}

// y (R, I) = act(gate) * up of one fused gate|up product (R, 2I), gate first: act 0 is SiLU
// (SwiGLU, Llama), 1 GELU's tanh form (GeGLU, Gemma), 0.5 g (1 + tanh(u)) written as
// g / (1 + e^(-2u)), which is the same function.
void glu(const float* gate_up, float* y, int64_t R, int64_t I, int act) {
    constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
    for (int64_t r = 0; r < R; ++r) {
        const float* g = gate_up + r * 2 * I;
        const float* u = g + I;
        float* yr = y + r * I;
        if (act == 0) {
#pragma omp simd
            for (int64_t i = 0; i < I; ++i) yr[i] = g[i] / (1.f + exp_clamped(-g[i])) * u[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < I; ++i) {
                const float t = -2.f * k * (g[i] + 0.044715f * g[i] * g[i] * g[i]);
                yr[i] = g[i] / (1.f + exp_clamped(t)) * u[i];
            }
        }
    }
}

// y (n) = x (n) times s: Gemma's embedding scale, so that its decoding step is native calls
// alone (a replayed step's: `generate.ReplayedDecode`).
void scale(const float* x, float s, float* y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s;
}

}  // extern "C"
