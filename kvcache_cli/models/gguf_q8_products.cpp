// A decoding row's products with GGUF blocks in llama.cpp's arithmetic: the row rounded to
// 8-bit blocks once a call, integer dot products with the weights' integers, the float
// scales after. The blocks are ggml's (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, the
// layouts `gguf_products.cpp` reads too); each is met by the row type its vec_dot takes in
// ggml's CPU backend: Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 (with d times the sum of its integers)
// for Q4_1/Q5_1, Q8_K (float d, sums a 16) for the k-quants.
//
// The row is rounded as ggml's x86 build rounds it (ggml-cpu/arch/x86/quants.c): Q8_0 and
// Q8_1 with d = amax / 127 stored as float16, integers round-to-even of x * (127 / amax);
// Q8_K as ggml-quants.c's quantize_row_q8_K_ref: iscale = -127 / (the element of largest
// magnitude), round-to-even, at most 127, d = 1 / iscale. Each block's integer sum is exact;
// the float sums, d_w d_x times it, and for Q4_1/Q5_1 m s, for the k-quants dmin d times the
// minimums against the sums a 32, follow ggml's vec_dot_*; only their order differs (lanes).
// So the product is llama.cpp's, not the dequantised matrix's (the `gguf` format's kernel).
//
// With AVX2 the dots are maddubs (unsigned weights times signed row, pairs to 16 bits) and
// madd, the signed types taking |w| and the row's signs moved onto it, as ggml does; with
// AVX-512 VNNI (and VL) dpbusd, the signed types of 32 as unsigned integers less an offset
// (`offset_dots`): the same integer in every lane, in one instruction. A decode's one row
// meets four weight rows a pass. -DGGUF_SCALAR builds plain loops, -DGGUF_AVX2 keeps AVX2 on
// a VNNI CPU: the tests build all three and compare. Built by `models/gguf/blocks.py`.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(GGUF_SCALAR)
#define Q8_SIMD 1
#define HALF_F16C 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(GGUF_AVX2)
#define Q8_VNNI 1
#endif
#endif

#include "half.h"

namespace {

// A constant the compiler cannot see: -ffast-math would turn a division by a known constant
// into a multiplication by its rounded reciprocal, and the rounding must be ggml's.
inline float opaque(float c) {
    volatile float v = c;
    return v;
}

// f rounded to the nearest float16, ties to even (F16C's and ggml's conversion), as a float.
float half_rounded(float f) {
#ifdef Q8_SIMD
    return _cvtsh_ss(_cvtss_sh(f, 0));
#else
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude < 0x38800000u) {  // under 2^-14: float16's subnormals, steps of 2^-24
        return std::nearbyint(f * 16777216.0f) * 5.9604644775390625e-8f;
    }
    if (magnitude >= 0x477ff000u) return std::copysign(INFINITY, f);  // past 65504
    bits += 0xfffu + ((bits >> 13) & 1);  // 23 bits of mantissa to 10, ties to even
    bits &= ~0x1fffu;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

// R rows rounded to the row type a weight type's dot takes; per row K integers and per block
// d (and s for Q8_1: float16 of d times the block's integer sum); sums16: each 16's integer
// sum (Q8_K's bsums), which the k-quants' minimums and Q6_K's offset of 32 are taken against.
struct Rows8 {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> sums16;
    std::vector<int32_t> lane_starts;  // with VNNI, Q8_0's row: 8 a block (`offset_dots`)
};

// ggml's x86 quantize_row_q8_0 / q8_1: one block of 32.
void round_q8_32(const float* x, int8_t* q, float& d, float& s) {
#ifdef Q8_SIMD
    // ggml's own steps: the largest |x| by lanes, x * (127 / it) rounded to even by
    // round_ps, packed to bytes (each lane's value is the plain loop's, below).
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], magnitude));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax8, 1), _mm256_castps256_ps128(amax8));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float dd = amax / opaque(127.0f);
    const __m256 id = _mm256_set1_ps(amax != 0.0f ? opaque(127.0f) / amax : 0.0f);
    __m256i n[4];
    for (int i = 0; i < 4; ++i)
        n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]),
                                          _mm256_add_epi32(n[2], n[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    const int sum = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
    // packs works within 128-bit halves: the permute puts the four runs of 8 back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                             _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6,
                                                                             3, 7)));
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float dd = amax / opaque(127.0f);
    const float id = amax != 0.0f ? opaque(127.0f) / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
        const int v = static_cast<int>(std::nearbyint(x[j] * id));
        q[j] = static_cast<int8_t>(v);
        sum += v;
    }
#endif
    d = half_rounded(dd);
    s = half_rounded(dd * static_cast<float>(sum));
}

// ggml's quantize_row_q8_K_ref: one block of 256.
void round_q8_k(const float* x, int8_t* q, float& d, int32_t* sums16) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; ++j) {
        if (std::fabs(x[j]) > amax) {  // the first of the largest magnitude, with its sign
            amax = std::fabs(x[j]);
            max = x[j];
        }
    }
    if (amax == 0.0f) {
        std::memset(q, 0, 256);
        std::memset(sums16, 0, 16 * sizeof(int32_t));
        d = 0.0f;
        return;
    }
    const float iscale = opaque(-127.0f) / max;
    for (int j = 0; j < 256; ++j) {
        const int v = static_cast<int>(std::nearbyint(iscale * x[j]));
        q[j] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    for (int g = 0; g < 16; ++g) {
        int32_t sum = 0;
        for (int j = 0; j < 16; ++j) sum += q[16 * g + j];
        sums16[g] = sum;
    }
    d = opaque(1.0f) / iscale;
}

// The rows rounded into a buffer kept between calls (a step makes some hundred of them).
Rows8& rounded(const float* x, int64_t R, int64_t K, bool k_blocks) {
    thread_local Rows8 r;
    const int64_t qk = k_blocks ? 256 : 32, nb = R * K / qk;
    r.q.resize(R * K);
    r.d.resize(nb);
    r.s.resize(nb);
    r.sums16.resize(R * K / 16);
    for (int64_t b = 0; b < nb; ++b) {
        if (k_blocks) {
            round_q8_k(x + qk * b, r.q.data() + qk * b, r.d[b], r.sums16.data() + 16 * b);
        } else {
            round_q8_32(x + qk * b, r.q.data() + qk * b, r.d[b], r.s[b]);
        }
    }
    return r;
}

// 32 weights' integers as bytes, and the integer dots of them with 32 of the row's.
#ifdef Q8_SIMD
using Bytes = __m256i;
using Ints = __m256i;  // 8 partial sums

inline Ints zero_ints() { return _mm256_setzero_si256(); }

// Unsigned weights (at most 127, so no pair of products leaves 16 bits) times the signed row.
inline Ints dot_u(Bytes w, __m256i y) {
#ifdef Q8_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, y);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), _mm256_set1_epi16(1));
#endif
}

inline __m256i row_bytes(const int8_t* y) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
}

inline Ints dot_unsigned(Bytes w, const int8_t* y) { return dot_u(w, row_bytes(y)); }

#ifdef Q8_VNNI
// The signed types' weights w as u - offset, u unsigned (Q4_0 0..15, Q5_0 0..31, Q8_0 w xor
// 0x80): dpbusd multiplies u with the row, each lane starting from -offset times the sum of
// its four row integers, so each lane ends on the very integer |w| times the row's signs
// gives (ggml's lanes), one instruction instead of three.
#define Q8_OFFSET_DOTS 1

// Each block of 32 of the row: its 8 lanes' starts for weights `offset` below their u.
void offset_dots(Rows8& x, int offset) {
    const int64_t nb = static_cast<int64_t>(x.d.size());
    x.lane_starts.resize(8 * nb);
    const __m256i ones = _mm256_set1_epi8(1), less = _mm256_set1_epi32(-offset);
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones,
                                                 row_bytes(x.q.data() + 32 * b));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.lane_starts.data() + 8 * b),
                            _mm256_mullo_epi32(sums, less));
    }
}

inline Ints dot_offset(Bytes u, const int8_t* y, const int32_t* starts) {
    return _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(starts)), u,
                               row_bytes(y));
}
#endif

// Signed weights: |w| times the row with w's signs (ggml's mul_sum_i8_pairs).
inline Ints dot_signed(Bytes w, const int8_t* y) {
    return dot_u(_mm256_sign_epi8(w, w), _mm256_sign_epi8(row_bytes(y), w));
}

// Unsigned weights (at most 63), the first 16 products times scale a, the next 16 times b.
inline Ints dot_scaled(Bytes w, const int8_t* y, int a, int b) {
    const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(b)),
                                            _mm_set1_epi16(static_cast<int16_t>(a)));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, row_bytes(y)), scales);
}

inline Ints add(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Ints minus(Ints a, int32_t c) {
    return _mm256_sub_epi32(a, _mm256_setr_epi32(c, 0, 0, 0, 0, 0, 0, 0));
}

struct Acc {
    __m256 v = _mm256_setzero_ps();
    void add(Ints i, float d) {
        v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d), v);
    }
    float sum() const {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
};

inline Bytes load32(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 16 bytes of nibbles: the low ones as weights 0..15, the high ones as 16..31.
inline Bytes nibbles16(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
}

inline Bytes low_nibbles(Bytes v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline Bytes high_nibbles(Bytes v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
}

// 0xff in byte j where bit j of the 32 bits is set.
inline Bytes bit_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i mask = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
}

inline Bytes or_bits(Bytes v, Bytes set, int value) {
    return _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(value))));
}
inline Bytes minus8(Bytes v, int c) {
    return _mm256_sub_epi8(v, _mm256_set1_epi8(static_cast<char>(c)));
}

// Each byte's bits at `shift` (a field of `width` bits) moved to bits 4 and up.
inline Bytes field_to_top(Bytes h, int shift, int width) {
    const __m256i f = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(shift)),
                                       _mm256_set1_epi8(static_cast<char>((1 << width) - 1)));
    return _mm256_slli_epi16(f, 4);  // at most 0x30: no bit crosses into the next byte
}
#else
struct Bytes {
    int8_t v[32];
};
using Ints = int32_t;

inline Ints zero_ints() { return 0; }
inline Ints dot_unsigned(const Bytes& w, const int8_t* y) {
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += w.v[j] * y[j];
    return s;
}
inline Ints dot_signed(const Bytes& w, const int8_t* y) { return dot_unsigned(w, y); }
inline Ints dot_scaled(const Bytes& w, const int8_t* y, int a, int b) {
    int32_t sa = 0, sb = 0;
    for (int j = 0; j < 16; ++j) {
        sa += w.v[j] * y[j];
        sb += w.v[16 + j] * y[16 + j];
    }
    return a * sa + b * sb;
}
inline Ints add(Ints a, Ints b) { return a + b; }
inline Ints minus(Ints a, int32_t c) { return a - c; }

struct Acc {
    float v = 0.0f;
    void add(Ints i, float d) { v += static_cast<float>(i) * d; }
    float sum() const { return v; }
};

inline Bytes load32(const uint8_t* p) {
    Bytes b;
    std::memcpy(b.v, p, 32);
    return b;
}
inline Bytes nibbles16(const uint8_t* p) {
    Bytes b;
    for (int j = 0; j < 16; ++j) {
        b.v[j] = static_cast<int8_t>(p[j] & 15);
        b.v[16 + j] = static_cast<int8_t>(p[j] >> 4);
    }
    return b;
}
inline Bytes low_nibbles(Bytes v) {
    for (auto& x : v.v) x = static_cast<int8_t>(static_cast<uint8_t>(x) & 15);
    return v;
}
inline Bytes high_nibbles(Bytes v) {
    for (auto& x : v.v) x = static_cast<int8_t>(static_cast<uint8_t>(x) >> 4);
    return v;
}
inline Bytes bit_bytes(uint32_t bits) {
    Bytes b;
    for (int j = 0; j < 32; ++j) b.v[j] = static_cast<int8_t>(((bits >> j) & 1) ? -1 : 0);
    return b;
}
inline Bytes or_bits(Bytes v, const Bytes& set, int value) {
    for (int j = 0; j < 32; ++j) v.v[j] = static_cast<int8_t>(v.v[j] | (set.v[j] & value));
    return v;
}
inline Bytes minus8(Bytes v, int c) {
    for (auto& x : v.v) x = static_cast<int8_t>(x - c);
    return v;
}
inline Bytes field_to_top(Bytes h, int shift, int width) {
    for (auto& x : h.v)
        x = static_cast<int8_t>(((static_cast<uint8_t>(x) >> shift) & ((1 << width) - 1)) << 4);
    return h;
}
#endif

// One weight block unpacked: its integers a 32 as bytes, its float scale(s), and the k-quants'
// integer scales and minimums.
struct Unpacked {
    Bytes q[8];
    float d, m;     // m: the _1 types' minimum; the k-quants' dmin
    int sc[16];     // Q4_K/Q5_K: one a 32 (8); Q6_K: one a 16
    int mins[8];
};

inline uint32_t u32_at(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// Q4_K/Q5_K's eight 6-bit scales and minimums, packed in 12 bytes (ggml's get_scale_min_k4).
inline void scales_and_mins(const uint8_t* s, Unpacked& u) {
    for (int j = 0; j < 8; ++j) {
        u.sc[j] = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        u.mins[j] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

enum RowType { ROW_Q8_0, ROW_Q8_1, ROW_Q8_K };

// Each type: QK weights in BYTES bytes, the row type its dot takes, how it unpacks, and how
// one unpacked block meets one row's block (acc: the float sums; off: the scalar terms).
struct Q4_0 {
    static constexpr int QK = 32, BYTES = 18;
    static constexpr RowType ROW = ROW_Q8_0;
    static constexpr int OFFSET = 8;
    static void unpack(const uint8_t* b, Unpacked& u) {
        u.d = from_half(half_at(b));
#ifdef Q8_OFFSET_DOTS
        u.q[0] = nibbles16(b + 2);
#else
        u.q[0] = minus8(nibbles16(b + 2), OFFSET);
#endif
    }
};

struct Q4_1 {
    static constexpr int QK = 32, BYTES = 20;
    static constexpr RowType ROW = ROW_Q8_1;
    static void unpack(const uint8_t* b, Unpacked& u) {
        u.d = from_half(half_at(b));
        u.m = from_half(half_at(b + 2));
        u.q[0] = nibbles16(b + 4);
    }
};

struct Q5_0 {
    static constexpr int QK = 32, BYTES = 22;
    static constexpr RowType ROW = ROW_Q8_0;
    static constexpr int OFFSET = 16;
    static void unpack(const uint8_t* b, Unpacked& u) {
        u.d = from_half(half_at(b));
#ifdef Q8_OFFSET_DOTS
        u.q[0] = or_bits(nibbles16(b + 6), bit_bytes(u32_at(b + 2)), 0x10);
#else
        // (q | fifth bit << 4) - 16: where the bit is clear, q - 16 is q with 0xf0 set
        u.q[0] = or_bits(nibbles16(b + 6), bit_bytes(~u32_at(b + 2)), 0xf0);
#endif
    }
};

struct Q5_1 {
    static constexpr int QK = 32, BYTES = 24;
    static constexpr RowType ROW = ROW_Q8_1;
    static void unpack(const uint8_t* b, Unpacked& u) {
        u.d = from_half(half_at(b));
        u.m = from_half(half_at(b + 2));
        u.q[0] = or_bits(nibbles16(b + 8), bit_bytes(u32_at(b + 4)), 0x10);
    }
};

struct Q8_0 {
    static constexpr int QK = 32, BYTES = 34;
    static constexpr RowType ROW = ROW_Q8_0;
    static constexpr int OFFSET = 128;
    static void unpack(const uint8_t* b, Unpacked& u) {
        u.d = from_half(half_at(b));
#ifdef Q8_OFFSET_DOTS
        u.q[0] = _mm256_xor_si256(load32(b + 2), _mm256_set1_epi8(static_cast<char>(0x80)));
#else
        u.q[0] = load32(b + 2);
#endif
    }
};

struct Q4_K {
    static constexpr int QK = 256, BYTES = 144;
    static constexpr RowType ROW = ROW_Q8_K;
    static void unpack(const uint8_t* b, Unpacked& u) {
        u.d = from_half(half_at(b));
        u.m = from_half(half_at(b + 2));
        scales_and_mins(b + 4, u);
        for (int c = 0; c < 4; ++c) {  // 32 bytes: the low nibbles 32 weights, the high 32 more
            const Bytes v = load32(b + 16 + 32 * c);
            u.q[2 * c] = low_nibbles(v);
            u.q[2 * c + 1] = high_nibbles(v);
        }
    }
};

struct Q5_K {
    static constexpr int QK = 256, BYTES = 176;
    static constexpr RowType ROW = ROW_Q8_K;
    static void unpack(const uint8_t* b, Unpacked& u) {
        u.d = from_half(half_at(b));
        u.m = from_half(half_at(b + 2));
        scales_and_mins(b + 4, u);
        const Bytes qh = load32(b + 16);
        for (int c = 0; c < 4; ++c) {  // run j of 32 takes bit j of qh[0..31]
            const Bytes v = load32(b + 48 + 32 * c);
            u.q[2 * c] = _or(low_nibbles(v), field_to_top(qh, 2 * c, 1));
            u.q[2 * c + 1] = _or(high_nibbles(v), field_to_top(qh, 2 * c + 1, 1));
        }
    }
#ifdef Q8_SIMD
    static Bytes _or(Bytes a, Bytes b) { return _mm256_or_si256(a, b); }
#else
    static Bytes _or(Bytes a, const Bytes& b) {
        for (int j = 0; j < 32; ++j) a.v[j] = static_cast<int8_t>(a.v[j] | b.v[j]);
        return a;
    }
#endif
};

struct Q6_K {
    static constexpr int QK = 256, BYTES = 210;
    static constexpr RowType ROW = ROW_Q8_K;
    static void unpack(const uint8_t* b, Unpacked& u) {
        u.d = from_half(half_at(b + 208));
        for (int g = 0; g < 16; ++g) u.sc[g] = static_cast<int8_t>(b[192 + g]);
        for (int h = 0; h < 2; ++h) {  // 128 weights: 64 bytes of ql, 32 of qh; 0..63 each
            const Bytes ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32);
            const Bytes qh = load32(b + 128 + 32 * h);
            u.q[4 * h] = Q5_K::_or(low_nibbles(ql0), field_to_top(qh, 0, 2));
            u.q[4 * h + 1] = Q5_K::_or(low_nibbles(ql1), field_to_top(qh, 2, 2));
            u.q[4 * h + 2] = Q5_K::_or(high_nibbles(ql0), field_to_top(qh, 4, 2));
            u.q[4 * h + 3] = Q5_K::_or(high_nibbles(ql1), field_to_top(qh, 6, 2));
        }
    }
};

// One unpacked block of B times block `b` of row `r` (its integers at y): into acc, off.
template <class B>
inline void meet(const Unpacked& u, const Rows8& x, const int8_t* y, int64_t blk, int64_t g16,
                 Acc& acc, float& off) {
    const float dx = x.d[blk];
    if constexpr (B::ROW == ROW_Q8_0) {
#ifdef Q8_OFFSET_DOTS
        acc.add(dot_offset(u.q[0], y, x.lane_starts.data() + 8 * blk), u.d * dx);
#else
        acc.add(dot_signed(u.q[0], y), u.d * dx);
#endif
    } else if constexpr (B::ROW == ROW_Q8_1) {
        acc.add(dot_unsigned(u.q[0], y), u.d * dx);
        off += u.m * x.s[blk];
    } else if constexpr (B::QK == 256 && B::BYTES == 210) {  // Q6_K: 0..63, less 32 each
        Ints sum = zero_ints();
        int32_t offset = 0;
        for (int j = 0; j < 8; ++j) {
            sum = add(sum, dot_scaled(u.q[j], y + 32 * j, u.sc[2 * j], u.sc[2 * j + 1]));
            offset += u.sc[2 * j] * x.sums16[g16 + 2 * j]
                      + u.sc[2 * j + 1] * x.sums16[g16 + 2 * j + 1];
        }
        acc.add(minus(sum, 32 * offset), u.d * dx);
    } else {  // Q4_K, Q5_K: the minimums against each 32's sum, apart (ggml's dmin term)
        Ints sum = zero_ints();
        int32_t mins = 0;
        for (int j = 0; j < 8; ++j) {
            sum = add(sum, dot_scaled(u.q[j], y + 32 * j, u.sc[j], u.sc[j]));
            mins += u.mins[j] * (x.sums16[g16 + 2 * j] + x.sums16[g16 + 2 * j + 1]);
        }
        acc.add(sum, u.d * dx);
        off -= u.m * dx * static_cast<float>(mins);
    }
}

constexpr int64_t AHEAD = 4096;  // bytes: one page ahead (gguf_products.cpp says why)

// RT rounded rows, from row r0, times NW weight rows (row_bytes apart) of K / QK blocks:
// y[r * ldy + i] for r < RT, i < NW. A decode's one row may meet four weight rows a pass:
// each of its blocks is then read once for four, and the four sums do not wait on each other
// (`four_weight_rows`). Each output's float terms are added in the same order whatever RT
// and NW are.
template <class B, int RT, int NW>
void rows_times(const uint8_t* w, int64_t row_bytes, const Rows8& x, int64_t r0, int64_t K,
                float* y, int64_t ldy) {
    Acc acc[RT][NW];
    float off[RT][NW] = {};
    Unpacked u;
    const int64_t nb = K / B::QK;
    for (int64_t b = 0; b < nb; ++b) {
        for (int i = 0; i < NW; ++i) {
            const uint8_t* block = w + i * row_bytes + b * B::BYTES;
            for (int o = 0; o < B::BYTES; o += 64) __builtin_prefetch(block + AHEAD + o);
            B::unpack(block, u);
            for (int r = 0; r < RT; ++r) {
                const int64_t row = r0 + r;
                const int64_t at = row * K + b * B::QK;
                meet<B>(u, x, x.q.data() + at, row * nb + b, at / 16, acc[r][i], off[r][i]);
            }
        }
    }
    for (int r = 0; r < RT; ++r)
        for (int i = 0; i < NW; ++i) y[r * ldy + i] = acc[r][i].sum() + off[r][i];
}

// One weight row (NW = 1) or, for a single rounded row of a type `four_weight_rows` names,
// WEIGHT_ROWS of them, times every rounded row: rows of x four at a time, so each block is
// unpacked once for four.
constexpr int WEIGHT_ROWS = 4;

// Whether one rounded row meets four weight rows a pass: for the 4- and 5-bit blocks of 32,
// whose unpacking bounds the product, so four sums that do not wait on each other help. Not
// for Q8_0, bound by its bytes: four rows' streams side by side came from memory slower than
// one (as in products.cpp; docs/bench.md, "One weight row a tile"). Not for the k-quants:
// an unpacked block of 256 is too large to keep four, and ran slower so.
template <class B>
constexpr bool four_weight_rows = B::QK == 32 && !std::is_same_v<B, Q8_0>;

template <class B, int NW>
void rows_of(const uint8_t* w, int64_t row_bytes, const Rows8& x, int64_t R, int64_t K,
             float* y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) rows_times<B, 4, NW>(w, row_bytes, x, r, K, y + r * ldy, ldy);
    float* yr = y + r * ldy;
    switch (R - r) {
        case 3: rows_times<B, 3, NW>(w, row_bytes, x, r, K, yr, ldy); break;
        case 2: rows_times<B, 2, NW>(w, row_bytes, x, r, K, yr, ldy); break;
        case 1: rows_times<B, 1, NW>(w, row_bytes, x, r, K, yr, ldy); break;
        default: break;
    }
}

// y (R rows, stride ldy) [:, :N] = x (R, K) rounded @ W^T, W's N rows each K / QK blocks.
template <class B>
void product(const float* x, const uint8_t* w, float* y, int64_t R, int64_t N, int64_t K,
             int64_t ldy, int threads) {
    Rows8& rows = rounded(x, R, K, B::ROW == ROW_Q8_K);  // once, before the threads
#ifdef Q8_OFFSET_DOTS
    if constexpr (B::ROW == ROW_Q8_0) offset_dots(rows, B::OFFSET);
#endif
    const int64_t row_bytes = K / B::QK * B::BYTES;
    // Several rows of x share each unpacked block already; one row may share its blocks
    // across weight rows instead (`four_weight_rows`). The threads take runs of whole groups,
    // as ggml's take chunks.
    const int64_t group = R == 1 && four_weight_rows<B> ? WEIGHT_ROWS : 1, groups = N / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t n = g * group;
        if (group == WEIGHT_ROWS) {
            rows_of<B, WEIGHT_ROWS>(w + n * row_bytes, row_bytes, rows, R, K, y + n, ldy);
        } else {
            rows_of<B, 1>(w + n * row_bytes, row_bytes, rows, R, K, y + n, ldy);
        }
    }
    for (int64_t n = groups * group; n < N; ++n)  // the few rows past the last whole group
        rows_of<B, 1>(w + n * row_bytes, row_bytes, rows, R, K, y + n, ldy);
}

}  // namespace

extern "C" {

// 0, or -1 for a type this file does not read. K: a whole number of the type's blocks.
// The type numbers are ggml's (GGMLQuantizationType).
int gguf_q8_product(int type, const float* x, const uint8_t* w, float* y, int64_t R, int64_t N,
                    int64_t K, int64_t ldy, int threads) {
    switch (type) {
        case 2: product<Q4_0>(x, w, y, R, N, K, ldy, threads); return 0;
        case 3: product<Q4_1>(x, w, y, R, N, K, ldy, threads); return 0;
        case 6: product<Q5_0>(x, w, y, R, N, K, ldy, threads); return 0;
        case 7: product<Q5_1>(x, w, y, R, N, K, ldy, threads); return 0;
        case 8: product<Q8_0>(x, w, y, R, N, K, ldy, threads); return 0;
        case 12: product<Q4_K>(x, w, y, R, N, K, ldy, threads); return 0;
        case 13: product<Q5_K>(x, w, y, R, N, K, ldy, threads); return 0;
        case 14: product<Q6_K>(x, w, y, R, N, K, ldy, threads); return 0;
        default: return -1;
    }
}

}  // extern "C"
