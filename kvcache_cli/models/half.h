// float16 widened to float32, exactly: the one conversion the product kernels share
// (products.cpp, gguf_products.cpp, gguf_q8_products.cpp), so each reads a float16 weight,
// scale or minimum the same way. A file defines HALF_F16C before including this where its
// vector path is built (F16C's instruction); elsewhere the bits are moved by hand, which a
// CPU without F16C runs and each file's plain-loop build (-D*_SCALAR) checks in the tests.
// Built into each kernel's library, which `caches/native.py` rebuilds when this changes.

#pragma once

#include <cstdint>
#include <cstring>

#ifdef HALF_F16C
#include <immintrin.h>
#endif

namespace {

inline float from_half(uint16_t h) {
#ifdef HALF_F16C
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float32
        const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13)
                                            : ((exp + 112) << 23) | (man << 13));
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

// The float16 stored at p, which a block's bytes need not align.
inline uint16_t half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return h;
}

}  // namespace
