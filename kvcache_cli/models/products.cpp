// One decoding row's products with a weight matrix, read once, on the CPU.
//
// Built at first use by `models/linear.py` (through `caches/native.py`), called through
// ctypes. A decode step multiplies a few rows by every matrix and does almost no arithmetic
// a weight, so its time is how fast the weights stream from memory. Each output is a dot
// product over one weight row (nn.Linear's (out, in) order, contiguous), threads take
// contiguous ranges of outputs, and each weight is widened to float32 in registers as it
// is read: int8 (times its row's bfloat16 scale, after the sum), float16 (F16C), or
// float32. Sums are float32 in four interleaved lanes of eight.

#include <cstdint>
#include <immintrin.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the product kernels need AVX2, FMA and F16C"
#endif

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

struct Int8 {
    using T = int8_t;
    static __m256 load(const T* p) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    static float one(T v) { return static_cast<float>(v); }
};

struct Half {
    using T = uint16_t;
    static __m256 load(const T* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static float one(T v) { return _cvtsh_ss(v); }
};

struct Float {
    using T = float;
    static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
    static float one(T v) { return v; }
};

template <class W>
inline float dot(const typename W::T* w, const float* x, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(W::load(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(W::load(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(W::load(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(W::load(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; ++k) s += W::one(w[k]) * x[k];
    return s;
}

inline float from_bf16(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;  // bfloat16: float32's top half
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

// y (R, N) = x (R, K) @ w (N, K)^T, each output times scales[n] where given, plus bias[n].
template <class W>
void product(const float* x, const typename W::T* w, const uint16_t* scales, const float* bias,
             float* y, int64_t R, int64_t N, int64_t K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const typename W::T* row = w + n * K;
        const float scale = scales ? from_bf16(scales[n]) : 1.0f, shift = bias ? bias[n] : 0.0f;
        for (int64_t r = 0; r < R; ++r) y[r * N + n] = dot<W>(row, x + r * K, K) * scale + shift;
    }
}

}  // namespace

extern "C" {

void product_int8(const float* x, const int8_t* w, const uint16_t* scales, const float* bias,
                  float* y, int64_t R, int64_t N, int64_t K, int threads) {
    product<Int8>(x, w, scales, bias, y, R, N, K, threads);
}

void product_f16(const float* x, const uint16_t* w, const float* bias, float* y, int64_t R,
                 int64_t N, int64_t K, int threads) {
    product<Half>(x, w, nullptr, bias, y, R, N, K, threads);
}

void product_f32(const float* x, const float* w, const float* bias, float* y, int64_t R,
                 int64_t N, int64_t K, int threads) {
    product<Float>(x, w, nullptr, bias, y, R, N, K, threads);
}

}  // extern "C"
