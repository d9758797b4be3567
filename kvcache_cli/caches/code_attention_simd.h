// Part of code_attention.cpp and paged_attention.cpp, included inside their anonymous
// namespaces after attention_common.h (Cache, Format, kBytes, block_softmax).
//
// The same partial sums in vector registers: kLanes numbers a vector, 16 with AVX-512, 8
// with AVX2 (and FMA, F16C), where the few operations below differ and the rest is written
// once. Where the plain loops' time went (perf samples): each dot product of a key with a
// query ended in a reduction across the vector's lanes (some 8 shuffles and adds after 4
// multiply-adds at a head size of 64); the values' accumulators lived in memory (they may
// alias the row being read, so every multiply-add loaded and stored one); codes and float16
// scales were widened one number at a time, and a group's index was a division a read. Here
// a key row is widened once and multiplied with each of its KV head's queries (GQA: read
// once for all of them), two tokens at a time so their multiply-add chains overlap; kLanes
// tokens' lane vectors are reduced together (`lane_sums`: 16 dot products in 46 operations
// with AVX-512); the values' accumulators of up to 4 queries stay in registers over a
// block's tokens; codes are widened a vector at a time and a block's scales in one pass;
// rows are prefetched ahead. Sums run in another order than the plain loops' (as
// -ffast-math already lets those); the arithmetic is the same: a key or value dequantised
// (code * scale + zero), then float32 products and sums.
// Shapes it takes: head sizes a multiple of kLanes, groups a multiple of kLanes or dividing
// it. -DCODE_ATTENTION_AVX2 keeps an AVX-512 CPU to AVX2's lanes, so the tests check both.
#if !defined(CODE_ATTENTION_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    !defined(CODE_ATTENTION_AVX2)
#define CODE_ATTENTION_SIMD 16
#elif !defined(CODE_ATTENTION_SCALAR) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#define CODE_ATTENTION_SIMD 8
#endif
#ifdef CODE_ATTENTION_SIMD
namespace simd {

constexpr int64_t kLanes = CODE_ATTENTION_SIMD;

#if CODE_ATTENTION_SIMD == 16
using vec = __m512;
using lane_index = __m512i;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline void store_first(float* p, vec x, int64_t n) {  // lanes 0 .. n - 1
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), x);
}
inline vec broadcast(float x) { return _mm512_set1_ps(x); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float lanes_total(vec x) { return _mm512_reduce_add_ps(x); }
inline vec permute(lane_index i, vec x) { return _mm512_permutexvar_ps(i, x); }
inline lane_index lanes_over(int shift) {  // lane l's number: l >> shift
    return _mm512_srlv_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(shift));
}

// Lane t of the result: the sum of v[t]'s 16 lanes. A transpose-and-add tree: pairs of
// vectors exchange halves, then quarters, then pairs and single lanes of each quarter.
inline vec lane_sums(const vec* v) {
    __m512 w[8], u[4], s[2];
    for (int k = 0; k < 8; ++k)  // lanes 0-3 token 2k's partial sums, 4-7 token 2k + 1's ...
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; ++k)  // quarter j: token 4k + j's 4 partial sums
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; ++k)  // quarter j: tokens 8k + j and 8k + 4 + j, 2 sums each
        s[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88),
                                   _mm512_shuffle_ps(s[0], s[1], 0xDD));  // lane 4j + e: j + 4e
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// 16 codes of `bits` bits from p (the first in the lowest bits of p[0]), as float32.
template <int bits>
inline vec codes(const uint8_t* p) {
    if constexpr (bits == 8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    } else {
        constexpr int per = 8 / bits;  // codes a byte: each byte copied to `per` lanes,
        int64_t word = 0;              // then shifted by its code's place and masked
        std::memcpy(&word, p, 16 / per);
        __m128i spread;
        __m512i shift;
        if constexpr (bits == 4) {
            spread = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
            shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        } else {
            spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            shift = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
        }
        const __m512i lanes = _mm512_srlv_epi32(
            _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi64_si128(word), spread)), shift);
        // a table of the code values read by the lanes' low 4 bits (vpermps ignores the
        // rest): the mask and the conversion to float in one operation
        const __m512 values = bits == 4 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                         12, 13, 14, 15)
                                        : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3,
                                                         0, 1, 2, 3);
        return _mm512_permutexvar_ps(lanes, values);
    }
}

// 16 stored numbers from p widened to float32.
template <int fmt>
inline vec widen(const char* p) {
    if constexpr (fmt == kF32) return _mm512_loadu_ps(p);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (fmt == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16
}

#else  // AVX2: 8 lanes, 16 registers
using vec = __m256;
using lane_index = __m256i;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline void store_first(float* p, vec x, int64_t n) {  // lanes 0 .. n - 1
    const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, first, x);
}
inline vec broadcast(float x) { return _mm256_set1_ps(x); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float lanes_total(vec x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vec permute(lane_index i, vec x) { return _mm256_permutevar8x32_ps(x, i); }
inline lane_index lanes_over(int shift) {  // lane l's number: l >> shift
    return _mm256_srlv_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                             _mm256_set1_epi32(shift));
}

// Lane t of the result: the sum of v[t]'s 8 lanes. Pairwise sums of neighbouring lanes
// (vhaddps) twice leave each 128-bit half with 4 vectors' half-sums, then the halves add.
inline vec lane_sums(const vec* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // a: lanes 0-3 vectors 0-3's sums over their lanes 0-3, lanes 4-7 over their lanes 4-7
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// 8 codes of `bits` bits from p (the first in the lowest bits of p[0]), as float32.
template <int bits>
inline vec codes(const uint8_t* p) {
    if constexpr (bits == 8) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    } else {
        constexpr int per = 8 / bits;  // codes a byte: each byte copied to `per` lanes,
        int32_t word = 0;              // then shifted by its code's place and masked
        std::memcpy(&word, p, 8 / per);
        __m128i spread;
        __m256i shift;
        if constexpr (bits == 4) {
            spread = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0);
            shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
        } else {
            spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            shift = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        }
        const __m256i lanes = _mm256_srlv_epi32(
            _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(word), spread)), shift);
        return _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32((1 << bits) - 1)));
    }
}

// 8 stored numbers from p widened to float32.
template <int fmt>
inline vec widen(const char* p) {
    if constexpr (fmt == kF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (fmt == kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16
}
#endif

// Rows are read front to back, but the hardware prefetcher stops at each 4 KiB page and
// starts again only after misses: each row is asked for kAhead tokens early (4 KiB of float16
// rows of 64, less for codes), a prefetch never faults past the end.
constexpr int64_t kAhead = 32;
constexpr int64_t kChunks = 1024 / kLanes;  // of kLanes channels: head sizes up to 1,024

inline void lines(const void* p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64)
        _mm_prefetch(static_cast<const char*>(p) + at, _MM_HINT_T0);
}

// Readers: `chunk(t, c)`, channels kLanes * c onwards (kLanes of them) of the block's token t
// in float32; `unrolled`: whether the loops over a row's chunks are unrolled whole where the
// head size is known (a grouped reader's, so each chunk's group is a constant; a float
// reader's ran faster rolled).
template <int fmt>
struct Stored {  // full-precision rows, hs numbers a token
    static constexpr bool unrolled = false;
    const char* rows;
    int64_t hs;
    vec chunk(int64_t t, int64_t c) const {
        return widen<fmt>(rows + (t * hs + kLanes * c) * kBytes<fmt>);
    }
    void prefetch(int64_t t) const { lines(rows + t * hs * kBytes<fmt>, hs * kBytes<fmt>); }
};

// GS: the group size where it is a compile-time constant (the common 32), else 0. Then each
// chunk's group is a constant of the unrolled loops, and a group's scale and zero point are
// loaded once for all its chunks: read from a table, they were loaded again for each chunk,
// and loads, not arithmetic, bound these loops.
template <int bits, bool affine, int GS = 0>
struct Codes {  // codes a token, dequantised with its groups' scales (float32, J a token)
    static constexpr bool unrolled = GS > 0;
    const uint8_t* codes;  // or, not affine, the codes as they are (per-channel keys)
    int64_t width, J;
    const float *scale, *zero;
    int32_t first[kChunks];  // the group of chunk c's first channel (no division a read)
    lane_index lanes;        // groups narrower than a vector: lane l's, from the chunk's first
    bool narrow;
    Codes(const uint8_t* codes, int64_t width, int64_t J, int64_t G, const float* scale,
          const float* zero)
        : codes(codes), width(width), J(J), scale(scale), zero(zero),
          lanes(lanes_over(__builtin_ctzll(G))), narrow(G < kLanes) {
        for (int64_t c = 0; c < kChunks; ++c) first[c] = static_cast<int32_t>(kLanes * c / G);
    }
    void prefetch(int64_t t) const { lines(codes + t * width, width); }
    vec chunk(int64_t t, int64_t c) const {
        const vec x = simd::codes<bits>(codes + t * width + c * kLanes * bits / 8);
        if constexpr (!affine) return x;
        const int64_t at = t * J + (GS ? kLanes * c / GS : first[c]);
        if (GS ? GS >= kLanes : !narrow)
            return fmadd(x, broadcast(scale[at]), broadcast(zero[at]));
        return fmadd(x, permute(lanes, load(scale + at)), permute(lanes, load(zero + at)));
    }
};

// Scores of tokens t0 .. t1 - 1 for GQ queries (GQ rows of hs at q) into scores (rows len
// apart): a tile of kLanes tokens' lane-vectors, then `lane_sums`.
template <int GQ, int HS, class Reader>  // HS: the head size, or 0 (known at run time)
void key_scores(const Reader r, int64_t t0, int64_t t1, const float* q, int64_t hs_,
                float* scores, int64_t len) {
    const int64_t hs = HS ? HS : hs_;
    vec part[GQ][kLanes];
    for (int64_t tile = t0; tile < t1; tile += kLanes) {
        const int64_t n = t1 - tile < kLanes ? t1 - tile : kLanes;
        for (int64_t k = 0; k < kLanes; k += 2) {  // two tokens at once: twice the chains
            r.prefetch(tile + k + kAhead);
            r.prefetch(tile + k + 1 + kAhead);
            vec acc[2][GQ];
            for (int u = 0; u < 2; ++u)
                for (int i = 0; i < GQ; ++i) acc[u][i] = zero();
            const int64_t t0 = tile + k, t1 = k + 1 < n ? t0 + 1 : t0;  // past n: ignored
            const auto chunk = [&](int64_t c) __attribute__((always_inline)) {
                const vec x0 = r.chunk(t0, c), x1 = r.chunk(t1, c);
                for (int i = 0; i < GQ; ++i) {
                    vec qc = load(q + i * hs + kLanes * c);
                    // one load for both tokens: the compiler would read q again as each
                    // multiply-add's operand, and the loads, not the arithmetic, bound this
                    // loop (AVX2 on AMD Zen: 2 a cycle)
                    asm("" : "+v"(qc));
                    acc[0][i] = fmadd(qc, x0, acc[0][i]);
                    acc[1][i] = fmadd(qc, x1, acc[1][i]);
                }
            };
            if (k < n) {
                if constexpr (HS > 0 && Reader::unrolled) {
#pragma GCC unroll 16
                    for (int64_t c = 0; c < HS / kLanes; ++c) chunk(c);
                } else {
                    for (int64_t c = 0; c < hs / kLanes; ++c) chunk(c);
                }
            }
            for (int i = 0; i < GQ; ++i) {
                part[i][k] = acc[0][i];
                part[i][k + 1] = acc[1][i];
            }
        }
        for (int i = 0; i < GQ; ++i) store_first(scores + i * len + tile, lane_sums(part[i]), n);
    }
}

// `key_scores` at the common head sizes, known at compile time.
template <int GQ, class Reader>
void sized_scores(const Reader& r, int64_t t0, int64_t t1, const float* q, int64_t hs,
                  float* scores, int64_t len) {
    if (hs == 64) key_scores<GQ, 64>(r, t0, t1, q, hs, scores, len);
    else if (hs == 128) key_scores<GQ, 128>(r, t0, t1, q, hs, scores, len);
    else key_scores<GQ, 0>(r, t0, t1, q, hs, scores, len);
}

// acc (GQ rows of hs) = sum over the block's tokens t of p[i * len + t] * value t, NC
// vectors of channels at a time (hs a multiple of kLanes * NC), so the accumulators stay in
// registers over the block's tokens.
template <int GQ, int NC, int HS, class Reader>
void value_sums(const Reader r, int64_t len, const float* p, int64_t hs_, float* acc_out) {
    const int64_t hs = HS ? HS : hs_;
    const auto pass = [&](int64_t c0) __attribute__((always_inline)) {  // NC vectors from c0
        vec acc[GQ][NC];
        for (int i = 0; i < GQ; ++i)
            for (int c = 0; c < NC; ++c) acc[i][c] = zero();
        for (int64_t t = 0; t < len; ++t) {
            r.prefetch(t + kAhead);
            vec w[GQ];
            for (int i = 0; i < GQ; ++i) w[i] = broadcast(p[i * len + t]);
            for (int c = 0; c < NC; ++c) {
                const vec x = r.chunk(t, c0 + c);
                for (int i = 0; i < GQ; ++i) acc[i][c] = fmadd(w[i], x, acc[i][c]);
            }
        }
        for (int i = 0; i < GQ; ++i)
            for (int c = 0; c < NC; ++c) store(acc_out + i * hs + kLanes * (c0 + c), acc[i][c]);
    };
    if constexpr (HS > 0 && Reader::unrolled) {
#pragma GCC unroll 16
        for (int64_t c0 = 0; c0 < HS / kLanes; c0 += NC) pass(c0);
    } else {
        for (int64_t c0 = 0; c0 < hs / kLanes; c0 += NC) pass(c0);
    }
}

// `value_sums` with as many vectors of channels at a time as the registers hold beside GQ
// weights and a value: 4 in AVX-512's 32 registers; in AVX2's 16, 4 for up to 3 queries (all
// 16 registers at 3: each pass over the block reads the rows from the caches again, which
// cost more than a spill), 2 for 4.
template <int GQ, class Reader>
void sized_values(const Reader& r, int64_t len, const float* p, int64_t hs, float* acc_out) {
    constexpr int NC = kLanes == 16 || GQ <= 3 ? 4 : 2;
    if (hs == 64) value_sums<GQ, NC, 64>(r, len, p, hs, acc_out);
    else if (hs == 128) value_sums<GQ, NC, 128>(r, len, p, hs, acc_out);
    else if (hs % (kLanes * NC) == 0) value_sums<GQ, NC, 0>(r, len, p, hs, acc_out);
    else if (hs % (kLanes * 2) == 0) value_sums<GQ, 2, 0>(r, len, p, hs, acc_out);
    else value_sums<GQ, 1, 0>(r, len, p, hs, acc_out);
}

// f(GQ, i) for the g queries in groups of at most 4 (GQ a compile-time constant).
template <class F>
void by_queries(int64_t g, F f) {
    for (int64_t i = 0; i < g; i += 4) {
        const int64_t n = g - i < 4 ? g - i : 4;
        if (n == 4) f(std::integral_constant<int, 4>{}, i);
        else if (n == 3) f(std::integral_constant<int, 3>{}, i);
        else if (n == 2) f(std::integral_constant<int, 2>{}, i);
        else f(std::integral_constant<int, 1>{}, i);
    }
}

// The partial sums of g queries over a block of len tokens read by key and value readers;
// `keys(i0, GQ, scores)` fills GQ rows of scores from query i0.
template <class Keys, class Values>
void partial(Keys keys, const Values& values, int64_t g, int64_t len, int64_t hs,
             float* m_out, float* l_out, float* acc_out) {
    std::vector<float> scores(g * len);
    by_queries(g, [&](auto GQ, int64_t i) { keys(GQ, i, scores.data() + i * len); });
    block_softmax(scores.data(), g, len, hs, m_out, l_out, acc_out);
    by_queries(g, [&](auto GQ, int64_t i) {
        sized_values<decltype(GQ)::value>(values, len, scores.data() + i * len, hs,
                                          acc_out + i * hs);
    });
}


// Floats of n float16 numbers (scales and zero points), a vector more for `Codes`'
// whole-vector loads past the last.
inline std::vector<float> widened(const _Float16* x, int64_t n) {
    std::vector<float> out(n + kLanes, 0.f);
    int64_t e = 0;
    for (; e + kLanes <= n; e += kLanes)
        store(out.data() + e, widen<kF16>(reinterpret_cast<const char*>(x + e)));
    for (; e < n; ++e) out[e] = static_cast<float>(x[e]);
    return out;
}

// `block` on this path: tokens a .. b - 1 of cache row `row`, groups of GS (or G, GS = 0).
template <int bits, int GS>
void grouped_block(const float* q, const Cache& c, int64_t row, int64_t a, int64_t b,
                   int64_t g, int64_t hs, int64_t G, bool key_channels, float* m, float* l,
                   float* acc) {
    const int64_t len = b - a, width = hs * bits / 8, J = hs / G;
    const float* qr = q + row * g * hs;
    const std::vector<float> vs = widened(c.vs + row * c.vs_row + a * J, len * J),
                             vz = widened(c.vz + row * c.vs_row + a * J, len * J);
    const Codes<bits, true, GS> values{c.vc + row * c.vc_row + a * width, width, J, G, vs.data(),
                                       vz.data()};
    if (!key_channels) {  // per-token keys: dequantised as read, like the values
        const std::vector<float> ks = widened(c.ks + row * c.ks_row + a * J, len * J),
                                 kz = widened(c.kz + row * c.ks_row + a * J, len * J);
        const Codes<bits, true, GS> keys{c.kc + row * c.kc_row + a * width, width, J, G,
                                         ks.data(), kz.data()};
        return partial([&](auto GQ, int64_t i, float* s) {
            sized_scores<decltype(GQ)::value>(keys, 0, len, qr + i * hs, hs, s, len);
        }, values, g, len, hs, m, l, acc);
    }
    // per-channel keys: the codes as they are, times the query scaled by the scales of
    // their group of G tokens, plus the query's dot product with the group's zero points
    const Codes<bits, false> keys{c.kc + row * c.kc_row + a * width, width, J, G, nullptr, nullptr};
    partial([&](auto GQ, int64_t i, float* s) {
        constexpr int n = decltype(GQ)::value;
        std::vector<float> qs(n * hs);
        for (int64_t t0 = a; t0 < b;) {
            const int64_t t1 = (t0 / G + 1) * G < b ? (t0 / G + 1) * G : b;
            const _Float16* sc = c.ks + row * c.ks_row + t0 / G * hs;
            const _Float16* ze = c.kz + row * c.ks_row + t0 / G * hs;
            float offset[n];
            for (int k = 0; k < n; ++k) {
                const float* qk = qr + (i + k) * hs;
                vec off = zero();
                for (int64_t d = 0; d < hs; d += kLanes) {
                    const vec qd = load(qk + d);
                    store(qs.data() + k * hs + d,
                          mul(qd, widen<kF16>(reinterpret_cast<const char*>(sc + d))));
                    off = fmadd(qd, widen<kF16>(reinterpret_cast<const char*>(ze + d)), off);
                }
                offset[k] = lanes_total(off);
            }
            sized_scores<n>(keys, t0 - a, t1 - a, qs.data(), hs, s, len);
            for (int k = 0; k < n; ++k)
                for (int64_t t = t0 - a; t < t1 - a; ++t) s[k * len + t] += offset[k];
            t0 = t1;
        }
    }, values, g, len, hs, m, l, acc);
}

template <int bits>
void codes_block(const float* q, const Cache& c, int64_t row, int64_t a, int64_t b, int64_t g,
                 int64_t hs, int64_t G, bool key_channels, float* m, float* l, float* acc) {
    if (G == 32) grouped_block<bits, 32>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
    else grouped_block<bits, 0>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
}

// `half_block` on this path: stored tokens a .. b - 1 of one cache row.
template <int fmt>
void stored_block(const float* q, const void* k, const void* v, int64_t a, int64_t b,
                  int64_t g, int64_t hs, float* m, float* l, float* acc) {
    const int64_t at = a * hs * kBytes<fmt>;
    const Stored<fmt> keys{static_cast<const char*>(k) + at, hs},
                      values{static_cast<const char*>(v) + at, hs};
    partial([&](auto GQ, int64_t i, float* s) {
        sized_scores<decltype(GQ)::value>(keys, 0, b - a, q + i * hs, hs, s, b - a);
    }, values, g, b - a, hs, m, l, acc);
}

}  // namespace simd
#endif
