// What the attention kernels share (code_attention.cpp, paged_attention.cpp), included inside
// their anonymous namespaces before code_attention_simd.h, which builds on it: the code
// readers' argument, the formats a full-precision row is stored in, their sizes and a row of
// them widened to float32, e^x for a softmax, and a block's partial softmax.

struct Cache {
    const uint8_t *kc, *vc;
    const _Float16 *ks, *kz, *vs, *vz;
    int64_t kc_row, vc_row, ks_row, vs_row;  // elements from one cache row (b, h) to the next
};

// Numbers kept at full precision, by the flag the kernel takes: float16, bfloat16, float32.
enum Format { kF16 = 0, kBF16 = 1, kF32 = 2 };

// One row of hs stored numbers widened to float32.
template <int fmt>
inline void widen_row(const void* row, float* out, int64_t hs) {
    if constexpr (fmt == kF32) {
        std::memcpy(out, row, hs * sizeof(float));
    } else if constexpr (fmt == kBF16) {
        const uint16_t* x = static_cast<const uint16_t*>(row);
        for (int64_t d = 0; d < hs; ++d) {  // bf16 is the top 16 bits of a float32
            const uint32_t bits = static_cast<uint32_t>(x[d]) << 16;
            std::memcpy(out + d, &bits, sizeof bits);
        }
    } else {
        const uint16_t* x = static_cast<const uint16_t*>(row);
        int64_t d = 0;
#ifdef __F16C__
        for (; d + 8 <= hs; d += 8)
            _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(
                                          reinterpret_cast<const __m128i*>(x + d))));
#endif
        for (; d < hs; ++d) {
            _Float16 h;
            std::memcpy(&h, x + d, sizeof h);
            out[d] = static_cast<float>(h);
        }
    }
}

template <int fmt>
constexpr int64_t kBytes = fmt == kF32 ? 4 : 2;

#include "fast_exp.h"

// e^x for x <= 0 (a score less the largest); below -87.3 (e^x under float's smallest
// normal) the smallest normal.
inline float exp_nonpositive(float x) { return exp_in_range(x < -87.3f ? -87.3f : x); }

// A block's scores (g rows of len) turned in place into exp(s - m), with each row's max m
// and sum l written out for the merge across blocks (flash-decoding's partial softmax),
// and the row's accumulator zeroed for the values that follow.
inline void block_softmax(float* scores, int64_t g, int64_t len, int64_t hs, float* m_out,
                          float* l_out, float* acc_out) {
    for (int64_t i = 0; i < g; ++i) {
        float m = -INFINITY, l = 0.f;
        float* s = scores + i * len;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : l)
        for (int64_t t = 0; t < len; ++t) {
            s[t] = exp_nonpositive(s[t] - m);
            l += s[t];
        }
        m_out[i] = m;
        l_out[i] = l;
        for (int64_t d = 0; d < hs; ++d) acc_out[i * hs + d] = 0.f;
    }
}
