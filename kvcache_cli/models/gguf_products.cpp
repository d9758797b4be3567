// A decoding row's products with a GGUF matrix read as the file stores it: llama.cpp's
// blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the k-quants Q4_K, Q5_K, Q6_K), one weight row
// a run of whole blocks, no re-packing.
//
// Built at first use by `models/gguf/blocks.py` (through `caches/native.py`), called
// through ctypes. The layouts are ggml's (`ggml-common.h`; gguf-py's `quants.py` reads the
// same bytes, and the tests hold this file to it). A block is unpacked in registers into
// its integers q, one scale d per 16 weights and, for the types with a minimum, one offset
// m per 32: w = d q + m. llama.cpp rounds the activation row to 8-bit blocks and sums
// integer products; here the integers are widened to float32 and multiplied with the float32
// row as it is, so the product is the dequantised matrix's to float32 rounding (the same
// greedy tokens as the float model) and the bytes read a step are still the file's blocks.
// The offsets need only each run of 32 inputs' sum, computed once a call: sum(m x) = m sum(x).
//
// With AVX2/FMA/F16C the unpacking is SSE byte arithmetic and the products 8 or 16 float
// lanes (AVX-512 where the compiler targets it); without them, or built with -DGGUF_SCALAR,
// the same steps are plain loops. -DGGUF_AVX2 keeps to AVX2's lanes on an AVX-512 CPU: the
// tests build all three and compare, so the path of a machine with only AVX2 is checked too.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(GGUF_SCALAR)
#define GGUF_SIMD 1
#define HALF_F16C 1
#include <immintrin.h>
#endif

#include "half.h"

namespace {

// One block unpacked: w[i] = d[i / 16] * q[i] + m[i / 32] (m only where MINS).
struct Unpacked {
    alignas(64) int8_t q[256];
    float d[16];
    float m[8];
};

// 16 bytes of nibbles: the low ones to lo[0..15], the high ones to hi[0..15], minus `offset`.
inline void nibbles(const uint8_t* p, int8_t* lo, int8_t* hi, int offset) {
#ifdef GGUF_SIMD
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i f = _mm_set1_epi8(15), o = _mm_set1_epi8(static_cast<char>(offset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm_sub_epi8(_mm_and_si128(b, f), o));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi),
                     _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), f), o));
#else
    for (int j = 0; j < 16; ++j) {
        lo[j] = static_cast<int8_t>((p[j] & 15) - offset);
        hi[j] = static_cast<int8_t>((p[j] >> 4) - offset);
    }
#endif
}

// q[j] += 16 for each of the 16 weights whose bit j of `bits` is set (Q5_0/Q5_1's fifth bit).
inline void fifth_bits(uint32_t bits, int8_t* q) {
#ifdef GGUF_SIMD
    // Byte j takes the byte of `bits` that holds bit j, then tests its own bit.
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)),
                                            _mm_set_epi64x(0x0101010101010101LL, 0));
    const __m128i mask = _mm_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, mask), mask);
    __m128i* at = reinterpret_cast<__m128i*>(q);
    _mm_storeu_si128(at, _mm_add_epi8(_mm_loadu_si128(at),
                                      _mm_and_si128(set, _mm_set1_epi8(16))));
#else
    for (int j = 0; j < 16; ++j) q[j] = static_cast<int8_t>(q[j] + (((bits >> j) & 1) << 4));
#endif
}

// q[l] += 16 for each of 16 weights whose byte hb[l] has bit `bit` set (Q5_K's fifth bit).
inline void fifth_bytes(const uint8_t* hb, int bit, int8_t* q) {
#ifdef GGUF_SIMD
    const __m128i b = _mm_set1_epi8(static_cast<char>(1 << bit));
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hb));
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(v, b), b);
    __m128i* at = reinterpret_cast<__m128i*>(q);
    _mm_storeu_si128(at, _mm_add_epi8(_mm_loadu_si128(at),
                                      _mm_and_si128(set, _mm_set1_epi8(16))));
#else
    for (int l = 0; l < 16; ++l) q[l] = static_cast<int8_t>(q[l] + (((hb[l] >> bit) & 1) << 4));
#endif
}

// 16 weights of Q6_K: (low nibble or high nibble of ql) | (2 bits of qh at `shift`) << 4, - 32.
inline void six_bits(const uint8_t* ql, bool high, const uint8_t* qh, int shift, int8_t* q) {
#ifdef GGUF_SIMD
    const __m128i f = _mm_set1_epi8(15), three = _mm_set1_epi8(3);
    __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql));
    lo = _mm_and_si128(high ? _mm_srli_epi16(lo, 4) : lo, f);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh));
    // two bits of each byte to its bits 4 and 5: shifted as 16-bit lanes, masked to bytes
    const __m128i top = _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h, _mm_cvtsi32_si128(shift)),
                                                     three), 4);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                     _mm_sub_epi8(_mm_or_si128(lo, top), _mm_set1_epi8(32)));
#else
    for (int l = 0; l < 16; ++l) {
        const int low = high ? ql[l] >> 4 : ql[l] & 15;
        q[l] = static_cast<int8_t>((low | (((qh[l] >> shift) & 3) << 4)) - 32);
    }
#endif
}

// Q4_K/Q5_K's eight 6-bit scales and minimums, packed in 12 bytes (ggml's get_scale_min_k4).
inline void scales_and_mins(const uint8_t* s, float d, float dmin, Unpacked& u) {
    for (int j = 0; j < 8; ++j) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        u.d[2 * j] = u.d[2 * j + 1] = d * static_cast<float>(sc);
        u.m[j] = -(dmin * static_cast<float>(mn));
    }
}

// Each type: QK weights in BYTES bytes; unpack returns where its integers are.
struct Q4_0 {
    static constexpr int QK = 32, BYTES = 18;
    static constexpr bool MINS = false;
    static const int8_t* unpack(const uint8_t* b, Unpacked& u) {
        u.d[0] = u.d[1] = from_half(half_at(b));
        nibbles(b + 2, u.q, u.q + 16, 8);
        return u.q;
    }
};

struct Q4_1 {
    static constexpr int QK = 32, BYTES = 20;
    static constexpr bool MINS = true;
    static const int8_t* unpack(const uint8_t* b, Unpacked& u) {
        u.d[0] = u.d[1] = from_half(half_at(b));
        u.m[0] = from_half(half_at(b + 2));
        nibbles(b + 4, u.q, u.q + 16, 0);
        return u.q;
    }
};

struct Q5_0 {
    static constexpr int QK = 32, BYTES = 22;
    static constexpr bool MINS = false;
    static const int8_t* unpack(const uint8_t* b, Unpacked& u) {
        u.d[0] = u.d[1] = from_half(half_at(b));
        uint32_t qh;
        std::memcpy(&qh, b + 2, sizeof qh);
        nibbles(b + 6, u.q, u.q + 16, 16);  // (q | fifth bit) - 16 = q - 16 + 16 * bit
        fifth_bits(qh & 0xffff, u.q);
        fifth_bits(qh >> 16, u.q + 16);
        return u.q;
    }
};

struct Q5_1 {
    static constexpr int QK = 32, BYTES = 24;
    static constexpr bool MINS = true;
    static const int8_t* unpack(const uint8_t* b, Unpacked& u) {
        u.d[0] = u.d[1] = from_half(half_at(b));
        u.m[0] = from_half(half_at(b + 2));
        uint32_t qh;
        std::memcpy(&qh, b + 4, sizeof qh);
        nibbles(b + 8, u.q, u.q + 16, 0);
        fifth_bits(qh & 0xffff, u.q);
        fifth_bits(qh >> 16, u.q + 16);
        return u.q;
    }
};

struct Q8_0 {
    static constexpr int QK = 32, BYTES = 34;
    static constexpr bool MINS = false;
    static const int8_t* unpack(const uint8_t* b, Unpacked& u) {
        u.d[0] = u.d[1] = from_half(half_at(b));
        return reinterpret_cast<const int8_t*>(b + 2);  // the integers as stored
    }
};

struct Q4_K {
    static constexpr int QK = 256, BYTES = 144;
    static constexpr bool MINS = true;
    static const int8_t* unpack(const uint8_t* b, Unpacked& u) {
        scales_and_mins(b + 4, from_half(half_at(b)), from_half(half_at(b + 2)), u);
        const uint8_t* qs = b + 16;
        for (int c = 0; c < 4; ++c) {  // 64 weights: the low nibbles of 32 bytes, then the high
            int8_t* q = u.q + 64 * c;
            nibbles(qs + 32 * c, q, q + 32, 0);
            nibbles(qs + 32 * c + 16, q + 16, q + 48, 0);
        }
        return u.q;
    }
};

struct Q5_K {
    static constexpr int QK = 256, BYTES = 176;
    static constexpr bool MINS = true;
    static const int8_t* unpack(const uint8_t* b, Unpacked& u) {
        scales_and_mins(b + 4, from_half(half_at(b)), from_half(half_at(b + 2)), u);
        const uint8_t *qh = b + 16, *qs = b + 48;
        for (int c = 0; c < 4; ++c) {
            int8_t* q = u.q + 64 * c;
            nibbles(qs + 32 * c, q, q + 32, 0);
            nibbles(qs + 32 * c + 16, q + 16, q + 48, 0);
            for (int s = 0; s < 2; ++s) {  // run j = 2c + s of 32 takes bit j of qh[0..31]
                fifth_bytes(qh, 2 * c + s, q + 32 * s);
                fifth_bytes(qh + 16, 2 * c + s, q + 32 * s + 16);
            }
        }
        return u.q;
    }
};

struct Q6_K {
    static constexpr int QK = 256, BYTES = 210;
    static constexpr bool MINS = false;
    static const int8_t* unpack(const uint8_t* b, Unpacked& u) {
        const float d = from_half(half_at(b + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        for (int g = 0; g < 16; ++g) u.d[g] = d * static_cast<float>(sc[g]);
        for (int h = 0; h < 2; ++h) {  // 128 weights: 64 bytes of ql, 32 of qh
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            int8_t* q = u.q + 128 * h;
            for (int l = 0; l < 32; l += 16) {
                six_bits(ql + l, false, qh + l, 0, q + l);
                six_bits(ql + 32 + l, false, qh + l, 2, q + 32 + l);
                six_bits(ql + l, true, qh + l, 4, q + 64 + l);
                six_bits(ql + 32 + l, true, qh + l, 6, q + 96 + l);
            }
        }
        return u.q;
    }
};

// 16 float lanes: 16 integers times their scale, multiplied into sums with 16 of x.
#if defined(GGUF_SIMD) && defined(__AVX512F__) && !defined(GGUF_AVX2)
struct Lanes {
    __m512 v = _mm512_setzero_ps();
    static Lanes widened(const int8_t* q, float d) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        return {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(d))};
    }
    void add(const Lanes& w, const float* x) { v = _mm512_fmadd_ps(w.v, _mm512_loadu_ps(x), v); }
    static Lanes dot2(const int8_t* q, const float* x) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
        return {_mm512_fmadd_ps(b, _mm512_loadu_ps(x + 16),
                                _mm512_mul_ps(a, _mm512_loadu_ps(x)))};
    }
    void add_scaled(const Lanes& p, float d) { v = _mm512_fmadd_ps(p.v, _mm512_set1_ps(d), v); }
    float sum() const { return _mm512_reduce_add_ps(v); }
};
#elif defined(GGUF_SIMD)
struct Lanes {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    static Lanes widened(const int8_t* q, float d) {
        const __m256 s = _mm256_set1_ps(d);
        const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8));
        return {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), s),
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s)};
    }
    void add(const Lanes& w, const float* x) {
        lo = _mm256_fmadd_ps(w.lo, _mm256_loadu_ps(x), lo);
        hi = _mm256_fmadd_ps(w.hi, _mm256_loadu_ps(x + 8), hi);
    }
    static __m256 ints(const int8_t* q) {
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    }
    static Lanes dot2(const int8_t* q, const float* x) {
        return {_mm256_fmadd_ps(ints(q + 16), _mm256_loadu_ps(x + 16),
                                _mm256_mul_ps(ints(q), _mm256_loadu_ps(x))),
                _mm256_fmadd_ps(ints(q + 24), _mm256_loadu_ps(x + 24),
                                _mm256_mul_ps(ints(q + 8), _mm256_loadu_ps(x + 8)))};
    }
    void add_scaled(const Lanes& p, float d) {
        const __m256 s = _mm256_set1_ps(d);
        lo = _mm256_fmadd_ps(p.lo, s, lo);
        hi = _mm256_fmadd_ps(p.hi, s, hi);
    }
    float sum() const {
        const __m256 v = _mm256_add_ps(lo, hi);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_hadd_ps(s, s);
        return _mm_cvtss_f32(_mm_hadd_ps(s, s));
    }
};
#else
struct Lanes {
    float v[16] = {};
    static Lanes widened(const int8_t* q, float d) {
        Lanes w;
        for (int i = 0; i < 16; ++i) w.v[i] = d * static_cast<float>(q[i]);
        return w;
    }
    void add(const Lanes& w, const float* x) {
        for (int i = 0; i < 16; ++i) v[i] += w.v[i] * x[i];
    }
    static Lanes dot2(const int8_t* q, const float* x) {
        Lanes p;
        for (int i = 0; i < 16; ++i)
            p.v[i] = static_cast<float>(q[i]) * x[i] + static_cast<float>(q[16 + i]) * x[16 + i];
        return p;
    }
    void add_scaled(const Lanes& p, float d) {
        for (int i = 0; i < 16; ++i) v[i] += p.v[i] * d;
    }
    float sum() const {
        float s = 0;
        for (float f : v) s += f;
        return s;
    }
};
#endif

// Every type but Q6_K has one scale a run of 32 weights: d[2i] = d[2i + 1]. A single row then
// sums each 32 products before scaling them (several rows scale the weights once instead).
template <class B>
constexpr bool PAIRED = !std::is_same_v<B, Q6_K>;

constexpr int64_t AHEAD = 4096;  // bytes: one page ahead of the block being multiplied

// RT rows of x (each K wide, row stride K) times one weight row of `blocks` blocks:
// y[r * ldy] for r < RT. xs: each row's sums over runs of 32 inputs (K / 32 a row).
template <class B, int RT>
void rows_times(const uint8_t* w, const float* x, const float* xs, int64_t K, float* y,
                int64_t ldy) {
    Lanes acc[RT];
    float offset[RT] = {};
    Unpacked u;
    for (int64_t b = 0; b < K / B::QK; ++b) {
        // The rows lie end to end, so the matrix is one stream; the hardware's prefetcher
        // stops at each 4 KiB page and starts again only after the first misses on the next,
        // so each block asks for the bytes one page ahead (a step ran 1.1-1.5 times faster
        // on Q8_0/Q4_1 rows read from memory; past the matrix's end the hint is a no-op).
        for (int o = 0; o < B::BYTES; o += 64) __builtin_prefetch(w + b * B::BYTES + AHEAD + o);
        const int8_t* q = B::unpack(w + b * B::BYTES, u);
        const float* xb = x + b * B::QK;
        if constexpr (RT == 1 && PAIRED<B>) {
            for (int g = 0; g < B::QK / 16; g += 2)  // one scale a pair: 3 float ops a pair, not 4
                acc[0].add_scaled(Lanes::dot2(q + 16 * g, xb + 16 * g), u.d[g]);
        } else {
            for (int g = 0; g < B::QK / 16; ++g) {
                const Lanes scaled = Lanes::widened(q + 16 * g, u.d[g]);
                for (int r = 0; r < RT; ++r) acc[r].add(scaled, xb + r * K + 16 * g);
            }
        }
        if constexpr (B::MINS) {
            const float* sb = xs + b * (B::QK / 32);
            for (int s = 0; s < B::QK / 32; ++s)
                for (int r = 0; r < RT; ++r) offset[r] += u.m[s] * sb[r * (K / 32) + s];
        }
    }
    for (int r = 0; r < RT; ++r) y[r * ldy] = acc[r].sum() + offset[r];
}

// y (R rows, stride ldy) [:, :N] = x (R, K) @ W^T, W's N rows each K / QK blocks of B.
template <class B>
void product(const float* x, const uint8_t* w, float* y, int64_t R, int64_t N, int64_t K,
             int64_t ldy, int threads) {
    std::vector<float> xs;  // (R, K / 32): only the types with a minimum read it
    if (B::MINS) {
        xs.resize(R * (K / 32));
        for (int64_t i = 0; i < R * (K / 32); ++i) {
            float s = 0;
            for (int j = 0; j < 32; ++j) s += x[32 * i + j];
            xs[i] = s;
        }
    }
    const int64_t row_bytes = K / B::QK * B::BYTES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = w + n * row_bytes;
        int64_t r = 0;  // rows of x four at a time: each block unpacked once for four
        for (; r + 4 <= R; r += 4)
            rows_times<B, 4>(row, x + r * K, xs.data() + r * (K / 32), K, y + r * ldy + n, ldy);
        const float* xr = x + r * K;
        const float* sr = xs.data() + r * (K / 32);
        float* yr = y + r * ldy + n;
        switch (R - r) {
            case 3: rows_times<B, 3>(row, xr, sr, K, yr, ldy); break;
            case 2: rows_times<B, 2>(row, xr, sr, K, yr, ldy); break;
            case 1: rows_times<B, 1>(row, xr, sr, K, yr, ldy); break;
            default: break;
        }
    }
}

// out (N, K) float32 = W's N rows of blocks, unpacked: for a prefill's many rows, which
// torch's matrix product then multiplies a slice of rows at a time.
template <class B>
void dequantize(const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
    const int64_t row_bytes = K / B::QK * B::BYTES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        Unpacked u;
        for (int64_t b = 0; b < K / B::QK; ++b) {
            const int8_t* q = B::unpack(w + n * row_bytes + b * B::BYTES, u);
            float* o = out + n * K + b * B::QK;
            for (int i = 0; i < B::QK; ++i)
                o[i] = u.d[i / 16] * static_cast<float>(q[i]) + (B::MINS ? u.m[i / 32] : 0.0f);
        }
    }
}

// ggml's type numbers (GGMLQuantizationType): what the caller passes.
template <template <class> class Call, class... A>
int by_type(int type, A... args) {
    switch (type) {
        case 2: Call<Q4_0>::run(args...); return 0;
        case 3: Call<Q4_1>::run(args...); return 0;
        case 6: Call<Q5_0>::run(args...); return 0;
        case 7: Call<Q5_1>::run(args...); return 0;
        case 8: Call<Q8_0>::run(args...); return 0;
        case 12: Call<Q4_K>::run(args...); return 0;
        case 13: Call<Q5_K>::run(args...); return 0;
        case 14: Call<Q6_K>::run(args...); return 0;
        default: return -1;
    }
}

template <class B>
struct Product {
    static void run(const float* x, const uint8_t* w, float* y, int64_t R, int64_t N, int64_t K,
                    int64_t ldy, int threads) {
        product<B>(x, w, y, R, N, K, ldy, threads);
    }
};

template <class B>
struct Dequantize {
    static void run(const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
        dequantize<B>(w, out, N, K, threads);
    }
};

}  // namespace

extern "C" {

// 0, or -1 for a type this file does not read. K: a whole number of the type's blocks.
int gguf_product(int type, const float* x, const uint8_t* w, float* y, int64_t R, int64_t N,
                 int64_t K, int64_t ldy, int threads) {
    return by_type<Product>(type, x, w, y, R, N, K, ldy, threads);
}

int gguf_dequantize(int type, const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
    return by_type<Dequantize>(type, w, out, N, K, threads);
}

}  // extern "C"
