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
// -ffast-math already lets those), and three things differ from them:
// - keys of 8-bit codes (per token, in groups of 32, at head sizes 64 and 128) and of 8 or 4
//   bits (per channel, at 64, 128 and 256) are multiplied in integers (`word_dots`): the
//   query rounded to 16-bit words, each within 1.5e-5 of its row's largest number, which
//   moves a score by some 1e-5 of it (the codes' own rounding moves it a hundred times more);
// - 4-bit values in groups of a multiple of 32 are multiplied in integers (`word_values`):
//   the softmax's weights times the scales rounded to 16-bit words, which moves an output by
//   some 1e-4 of it;
// - 8-bit values in groups of 32 fold their scales into the weights (`value_sums`).
// Every other key and value is dequantised (code * scale + zero), then float32 products and
// sums.
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
inline vec add_floats(vec a, vec b) { return _mm512_add_ps(a, b); }
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

// 2 * 16 codes of 4 bits from p (16 bytes, the first code in the lowest bits), as float32:
// one load and split for both vectors, where `codes<4>` takes 7 operations a vector.
inline void code_pair(const uint8_t* p, vec* out) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(b, mask), high = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(low, high)));
}

// 16 stored numbers from p widened to float32.
template <int fmt>
inline vec widen(const char* p) {
    if constexpr (fmt == kF32) return _mm512_loadu_ps(p);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (fmt == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16
}

// Integers, for the keys' integer dot products: 16-bit words, 32-bit sums.
using ivec = __m512i;
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec words(const uint8_t* p) {  // 2 * kLanes bytes, zero-extended
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline ivec load_words(const int16_t* p) { return _mm512_loadu_si512(p); }
inline ivec low_nibbles(ivec w) { return _mm512_and_si512(w, _mm512_set1_epi16(15)); }
inline ivec high_nibbles(ivec w) { return _mm512_srli_epi16(w, 4); }  // w < 256
inline ivec dot_pairs(ivec a, ivec b) { return _mm512_madd_epi16(a, b); }  // kLanes sums of 2
inline ivec add_ints(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline vec floats(ivec a) { return _mm512_cvtepi32_ps(a); }
inline ivec rounded(vec x) { return _mm512_cvtps_epi32(x); }  // to nearest, ties to even
inline ivec narrow(ivec a, ivec b) {  // a's 32-bit lanes then b's, as words (saturated)
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                    _mm512_packs_epi32(a, b));
}
inline void store_words(int16_t* p, ivec w) { _mm512_storeu_si512(p, w); }
inline vec larger(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec magnitude(vec x) { return _mm512_abs_ps(x); }
inline float lanes_max(vec x) { return _mm512_reduce_max_ps(x); }
inline ivec low_words(ivec w) { return _mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16); }
inline ivec high_words(ivec w) { return _mm512_srai_epi32(w, 16); }  // each lane's, signed
// For the values' integer products: kLanes bytes from each of a and b, a0 b0 a1 b1 ...,
// zero-extended to words (a 32-bit lane: byte m of both tokens).
inline ivec byte_pairs(const uint8_t* a, const uint8_t* b) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    return _mm512_cvtepu8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_unpacklo_epi8(x, y)), _mm_unpackhi_epi8(x, y), 1));
}
inline ivec shuffle_bytes(ivec w, __m128i order) {  // within each 16-byte lane
    return _mm512_shuffle_epi8(w, _mm512_broadcast_i32x4(order));
}
inline ivec quarters_paired(ivec w) {  // 8-byte quarters of each 32 bytes in order 0, 2, 1, 3
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 1, 3, 4, 6, 5, 7), w);
}
inline ivec broadcast_int(int32_t x) { return _mm512_set1_epi32(x); }

#else  // AVX2: 8 lanes, 16 registers
using vec = __m256;
using lane_index = __m256i;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline void store_first(float* p, vec x, int64_t n) {  // lanes 0 .. n - 1
    if (n == kLanes) return _mm256_storeu_ps(p, x);  // a masked store is slow on AMD Zen
    const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, first, x);
}
inline vec broadcast(float x) { return _mm256_set1_ps(x); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec add_floats(vec a, vec b) { return _mm256_add_ps(a, b); }
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

// 2 * 8 codes of 4 bits from p (8 bytes, the first code in the lowest bits), as float32:
// one load and split for both vectors, where `codes<4>` takes 7 operations a vector.
inline void code_pair(const uint8_t* p, vec* out) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(b, mask), high = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i both = _mm_unpacklo_epi8(low, high);  // the 16 codes in order
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8)));
}

// 8 stored numbers from p widened to float32.
template <int fmt>
inline vec widen(const char* p) {
    if constexpr (fmt == kF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (fmt == kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16
}

// Integers, for the keys' integer dot products: 16-bit words, 32-bit sums.
using ivec = __m256i;
inline ivec izero() { return _mm256_setzero_si256(); }
inline ivec words(const uint8_t* p) {  // 2 * kLanes bytes, zero-extended
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline ivec load_words(const int16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline ivec low_nibbles(ivec w) { return _mm256_and_si256(w, _mm256_set1_epi16(15)); }
inline ivec high_nibbles(ivec w) { return _mm256_srli_epi16(w, 4); }  // w < 256
inline ivec dot_pairs(ivec a, ivec b) { return _mm256_madd_epi16(a, b); }  // kLanes sums of 2
inline ivec add_ints(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline vec floats(ivec a) { return _mm256_cvtepi32_ps(a); }
inline ivec rounded(vec x) { return _mm256_cvtps_epi32(x); }  // to nearest, ties to even
inline ivec narrow(ivec a, ivec b) {  // a's 32-bit lanes then b's, as words (saturated)
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}
inline void store_words(int16_t* p, ivec w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
}
inline vec larger(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec magnitude(vec x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }
inline float lanes_max(vec x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline ivec low_words(ivec w) { return _mm256_srai_epi32(_mm256_slli_epi32(w, 16), 16); }
inline ivec high_words(ivec w) { return _mm256_srai_epi32(w, 16); }  // each lane's, signed
// For the values' integer products: kLanes bytes from each of a and b, a0 b0 a1 b1 ...,
// zero-extended to words (a 32-bit lane: byte m of both tokens).
inline ivec byte_pairs(const uint8_t* a, const uint8_t* b) {
    return _mm256_cvtepu8_epi16(
        _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}
inline ivec shuffle_bytes(ivec w, __m128i order) {  // within each 16-byte lane
    return _mm256_shuffle_epi8(w, _mm256_broadcastsi128_si256(order));
}
inline ivec quarters_paired(ivec w) {  // 8-byte quarters in order 0, 2, 1, 3
    return _mm256_permute4x64_epi64(w, 0xD8);
}
inline ivec broadcast_int(int32_t x) { return _mm256_set1_epi32(x); }
#endif

// Rows are read front to back, but the hardware prefetcher stops at each 4 KiB page and
// starts again only after misses: each row is asked for kAhead tokens early (4 KiB of float16
// rows of 64, less for codes), a prefetch never faults past the end.
constexpr int64_t kAhead = 32;
constexpr int64_t kChunks = 1024 / kLanes;  // of kLanes channels: head sizes up to 1,024

// A block's temporaries (its scores, its scales widened, ...): the calling thread's buffer
// `slot` of n elements, uninitialised, kept from block to block. A step at 8k tokens reads
// some 1,500 blocks, and allocating and zeroing each one's own took a tenth of the kernel.
enum Slot {
    kScores, kValueScales, kValueZeros, kKeyScales, kKeyZeros, kQuery, kUnits, kWeights,
    kPadded, kSlots
};

template <class T>
T* scratch(Slot slot, int64_t n) {
    thread_local std::vector<T> buffers[kSlots];
    std::vector<T>& buffer = buffers[slot];
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
    return buffer.data();
}

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
    static constexpr int group_size = GS;
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
    vec raw(int64_t t, int64_t c) const {  // chunk c's codes as they are
        return simd::codes<bits>(codes + t * width + c * kLanes * bits / 8);
    }
    vec chunk(int64_t t, int64_t c) const { return dequantised(raw(t, c), t, c); }
    vec dequantised(vec x, int64_t t, int64_t c) const {  // codes x of chunk c
        if constexpr (!affine) return x;
        const int64_t at = t * J + (GS ? kLanes * c / GS : first[c]);
        if (GS ? GS >= kLanes : !narrow)
            return fmadd(x, broadcast(scale[at]), broadcast(zero[at]));
        return fmadd(x, permute(lanes, load(scale + at)), permute(lanes, load(zero + at)));
    }
};

// 4-bit codes read two chunks at a time, from one load (`code_pair`); other readers and
// widths, a chunk at a time.
template <class Reader>
constexpr bool paired = false;
template <bool affine, int GS>
constexpr bool paired<Codes<4, affine, GS>> = true;

// Values whose group scales fold into the weights (`value_sums`): 8-bit affine codes in groups
// of a compile-time size, whole chunks each. (4-bit ones, read in pairs, measured slower so.)
template <class Reader>
constexpr bool folded = false;
template <int GS>
constexpr bool folded<Codes<8, true, GS>> = GS > 0 && GS % kLanes == 0;

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

// The keys' integer path, for 8-bit per-token keys in groups of 32 and 8- or 4-bit
// per-channel ones: a query row rounded to 16-bit words on one step (its largest magnitude to
// 32767), so a key's codes multiply it as integers, kWords channels an instruction
// (vpmaddwd), with no conversion to float or dequantisation a channel: the scales apply to
// each group's sum. A word is within half a step of the query, 1.5e-5 of the row's largest
// number: for the largest numbers finer than the float16 llama.cpp rounds a query to for its
// own f16 cache, and everywhere finer than the 8 bits it takes for a q8_0 or q4_0 one. The
// float path spent as much time on each channel's widening and dequantising as on its
// products.
constexpr int64_t kWords = 2 * kLanes;

// q (hs numbers, a multiple of 2 * kWords) rounded to words in out; returns the step (0 for
// a row of zeros). For 4-bit codes, packed two a byte, each 2 * kWords channels' words are
// put even channels first, then odd ones, the order `word_dots` unpacks a byte's two codes
// in. Vector code: this runs once per G tokens for per-channel keys, so a scalar loop here
// cost as much as the dot products.
inline float rounded_words(const float* q, int64_t hs, int bits, int16_t* out) {
    vec big = zero();
    for (int64_t d = 0; d < hs; d += kLanes) big = larger(big, magnitude(load(q + d)));
    const float largest = lanes_max(big);
    const vec inverse = broadcast(largest > 0.f ? 32767.f / largest : 0.f);
    const auto ints = [&](int64_t d) { return rounded(mul(load(q + d), inverse)); };
    for (int64_t d = 0; d < hs; d += 2 * kWords) {
        const ivec first = narrow(ints(d), ints(d + kLanes));  // channels d .. d + kWords - 1
        const ivec second = narrow(ints(d + 2 * kLanes), ints(d + 3 * kLanes));
        if (bits == 8) {
            store_words(out + d, first);
            store_words(out + d + kWords, second);
        } else {  // a 32-bit lane's low word is an even channel's, its high word an odd one's
            store_words(out + d, narrow(low_words(first), low_words(second)));
            store_words(out + d + kWords, narrow(high_words(first), high_words(second)));
        }
    }
    return largest / 32767.f;
}

// The integer dot products of GQ rounded queries (rows of HS words at q) with the codes of
// tokens t0 .. t1 - 1 (rows of HS * bits / 8 bytes), into dots[i * len + t] as float32: the
// whole row's for per-channel keys (P = HS), or for per-token keys the sum over groups of P
// channels of each group's times its scale (scale[t * J + j], J = HS / P groups a token).
// Tiles of kLanes tokens, as `key_scores`, but one token at a time, each query's words an
// operand read from memory: its GQ accumulators and unpacked codes then fit the registers.
// Two tokens at a time, the queries' words loaded once for both, took 14 of AVX2's 16 and
// the compiler spilled some 20 vectors a pair to the stack, whose stores bound the loop. No
// 32-bit sum can overflow: a lane adds HS / kLanes products of at most 255 * 32767.
template <int GQ, int HS, int bits, int P>
void word_dots(const uint8_t* codes, int64_t t0, int64_t t1, const int16_t* q,
               const float* scale, float* dots, int64_t len) {
    constexpr int64_t width = HS * bits / 8, J = HS / P;
    constexpr int64_t span = bits == 8 ? kWords : 2 * kWords;  // channels a vector of words
    static_assert(bits == 8 || bits == 4, "codes of 8 or 4 bits");
    static_assert(P % span == 0, "whole vectors of words a part");
    vec part[GQ][kLanes];
    for (int64_t tile = t0; tile < t1; tile += kLanes) {
        const int64_t n = t1 - tile < kLanes ? t1 - tile : kLanes;
        for (int64_t k = 0; k < kLanes; ++k) {
            vec sum[GQ];
            for (int i = 0; i < GQ; ++i) sum[i] = zero();
            if (k < n) {  // past n: zeros, their scores not stored
                const int64_t t = tile + k;
                const uint8_t* row = codes + t * width;
                lines(row + kAhead * width, width);
#pragma GCC unroll 8
                for (int64_t j = 0; j < J; ++j) {
                    ivec acc[GQ];
                    for (int i = 0; i < GQ; ++i) acc[i] = izero();
#pragma GCC unroll 8
                    for (int64_t c = j * P; c < (j + 1) * P; c += span) {
                        if constexpr (bits == 8) {
                            const ivec x = words(row + c);
                            for (int i = 0; i < GQ; ++i)
                                acc[i] = add_ints(acc[i], dot_pairs(x, load_words(q + i * HS + c)));
                        } else {  // a byte's two codes: channels c + 2m (low) and c + 2m + 1
                            const ivec w = words(row + c / 2);
                            const ivec low = low_nibbles(w), high = high_nibbles(w);
                            for (int i = 0; i < GQ; ++i)
                                acc[i] = add_ints(
                                    add_ints(acc[i], dot_pairs(low, load_words(q + i * HS + c))),
                                    dot_pairs(high, load_words(q + i * HS + c + kWords)));
                        }
                    }
                    if constexpr (J == 1) {
                        for (int i = 0; i < GQ; ++i) sum[i] = floats(acc[i]);
                    } else {
                        const vec s = broadcast(scale[t * J + j]);
                        for (int i = 0; i < GQ; ++i) sum[i] = fmadd(floats(acc[i]), s, sum[i]);
                    }
                }
            }
            for (int i = 0; i < GQ; ++i) part[i][k] = sum[i];
        }
        for (int i = 0; i < GQ; ++i) store_first(dots + i * len + tile, lane_sums(part[i]), n);
    }
}

// GQ queries from qr (rows of hs) rounded to words in out (`rounded_words`), their steps in
// step.
template <int GQ>
void query_words(const float* qr, int64_t hs, int bits, int16_t* out, float* step) {
    for (int i = 0; i < GQ; ++i) step[i] = rounded_words(qr + i * hs, hs, bits, out + i * hs);
}

// sums[j] = the sum over tokens t < len of p[t] * zeros[t * J + j], J groups a token: a vector
// of zero points holds kLanes / J tokens' J groups, multiplied by their weights spread to
// match (lane l: token l / J), where J divides kLanes; J more lanes' sums at the end.
inline void zero_shares(const float* p, const float* zeros, int64_t len, int64_t J, float* sums) {
    for (int64_t j = 0; j < J; ++j) sums[j] = 0.f;
    int64_t t = 0;
    if (kLanes % J == 0) {
        const lane_index spread = lanes_over(__builtin_ctzll(J));
        vec acc = zero();
        for (; t + kLanes <= len; t += kLanes / J)  // loads p[t .. t + kLanes): inside len
            acc = fmadd(permute(spread, load(p + t)), load(zeros + t * J), acc);
        float lanes[kLanes];
        store(lanes, acc);
        for (int64_t l = 0; l < kLanes; ++l) sums[l % J] += lanes[l];
    }
    for (; t < len; ++t)
        for (int64_t j = 0; j < J; ++j) sums[j] += p[t] * zeros[t * J + j];
}

// acc (GQ rows of hs) = sum over the block's tokens t of p[i * len + t] * value t, NC
// vectors of channels at a time (hs a multiple of kLanes * NC), so the accumulators stay in
// registers over the block's tokens. Values in groups of a known size (`folded`) are not
// dequantised: p * (c * scale + zero) = (p * scale) * c + p * zero, the weights times a
// group's scale once a token and the zero points' share summed apart, once a block. The
// dequantising multiply-add needed 2 registers more than AVX2's 16 at 3 queries, and the
// spilled accumulator's store and reload bound the loop.
template <int GQ, int NC, int HS, class Reader>
void value_sums(const Reader r, int64_t len, const float* p, int64_t hs_, float* acc_out) {
    const int64_t hs = HS ? HS : hs_;
    float shares[GQ][kChunks];  // folded: sum over t of p * zero point, a query and group
    if constexpr (folded<Reader>)
        for (int i = 0; i < GQ; ++i) zero_shares(p + i * len, r.zero, len, r.J, shares[i]);
    const auto pass = [&](int64_t c0) __attribute__((always_inline)) {  // NC vectors from c0
        // chunks a group, and the groups a pass reads (or 1: a part of one)
        constexpr int64_t G = [] {
            if constexpr (folded<Reader>) return Reader::group_size / kLanes;
            else return NC;
        }();
        constexpr int64_t groups = NC > G ? NC / G : 1;
        const int64_t g0 = c0 / G;  // the pass's first group
        vec acc[GQ][NC];
        for (int i = 0; i < GQ; ++i)
            for (int c = 0; c < NC; ++c) acc[i][c] = zero();
        for (int64_t t = 0; t < len; ++t) {
            r.prefetch(t + kAhead);
            vec w[GQ][groups];
            if constexpr (folded<Reader>) {
                for (int64_t k = 0; k < groups; ++k) {
                    const vec scale = broadcast(r.scale[t * r.J + g0 + k]);
                    for (int i = 0; i < GQ; ++i) w[i][k] = mul(broadcast(p[i * len + t]), scale);
                }
            } else {
                for (int i = 0; i < GQ; ++i) w[i][0] = broadcast(p[i * len + t]);
            }
            const auto add = [&](int64_t c, vec x) __attribute__((always_inline)) {
                for (int i = 0; i < GQ; ++i)
                    acc[i][c] = fmadd(w[i][(c0 + c) / G - g0], x, acc[i][c]);
            };
            if constexpr (paired<Reader> && NC % 2 == 0) {
                for (int c = 0; c < NC; c += 2) {
                    vec x[2];
                    code_pair(r.codes + t * r.width + (c0 + c) * kLanes / 2, x);
                    for (int k = 0; k < 2; ++k) add(c + k, r.dequantised(x[k], t, c0 + c + k));
                }
            } else if constexpr (folded<Reader>) {
                for (int c = 0; c < NC; ++c) add(c, r.raw(t, c0 + c));
            } else {
                for (int c = 0; c < NC; ++c) add(c, r.chunk(t, c0 + c));
            }
        }
        if constexpr (folded<Reader>)  // the zero points' share of each group
            for (int i = 0; i < GQ; ++i)
                for (int64_t c = 0; c < NC; ++c)
                    acc[i][c] = add_floats(acc[i][c], broadcast(shares[i][(c0 + c) / G]));
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

// 4-bit values multiplied in integers: sum over t of p[t] * (c * scale + zero) is
// (p * scale) * c summed, plus the zero points' share, and the weights p * scale, rounded to
// 16-bit words, multiply two tokens' codes a lane (vpmaddwd: w[t] * c[t] + w[t + 1] *
// c[t + 1]) with no conversion to float or dequantisation a channel, where each multiply-add
// widened a code to float and dequantised it before. The step is the block's largest scale
// over 32767: the softmax's weights are at most 1 (each block's scores less their largest),
// so no word saturates, and the step is the same for every query. A weight is within half a
// step, 1.5e-5 of the block's largest scale; the codes' own rounding moves a value by up to
// 1/30 of its group's range. Groups of a multiple of 32 channels (whole passes of 2 * kLanes
// each), and J = hs / G of 1, 2, 4 or 8 (`paired_words`' shuffles).
template <class Reader>
constexpr bool word_valued = false;
template <int GS>
constexpr bool word_valued<Codes<4, true, GS>> = true;

inline bool values_in_words(int64_t hs, int64_t J) {
    return hs % J == 0 && (hs / J) % 32 == 0 && (J == 1 || J == 2 || J == 4 || J == 8);
}

// Words in (token, group) order, J groups a token, put each pair of tokens' words for a
// group side by side: token 2u's then 2u + 1's word for group j in 32-bit lane u * J + j.
// Up to J = 4 a pair's 2J words lie in one 16-byte lane, so this is a shuffle within lanes;
// J = 8's (Gemma 3's heads of 256 in groups of 32) span two, whose halves are brought
// together first.
inline ivec paired_words(ivec w, int64_t J) {
    const __m128i fours = _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    if (J == 2) return shuffle_bytes(w, _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13,
                                                      10, 11, 14, 15));
    if (J == 4) return shuffle_bytes(w, fours);
    if (J == 8) return shuffle_bytes(quarters_paired(w), fours);
    return w;  // J == 1: already so
}

// acc (GQ rows of hs) = sum over the block's len tokens of p[i * len + t] * value t, as
// `value_sums`, for 4-bit values where `values_in_words`. Each pass reads 2 * kLanes
// channels (kLanes bytes) of each token: a lane's low nibbles are even channels, its high
// ones odd. No 32-bit sum can overflow for len up to 4369 (15 * 32767 a token).
template <int GQ, class Reader>
void word_values(const Reader& r, int64_t len, const float* p, int64_t hs, float* acc_out) {
    const int64_t J = r.J, G = hs / J, pairs = (len + 1) / 2;
    // weights' entries (token, group), whole vectors of words; the padding's weights are 0
    const int64_t entries = (2 * pairs * J + 2 * kLanes - 1) / (2 * kLanes) * (2 * kLanes);
    vec big = zero();
    for (int64_t e = 0; e < entries; e += kLanes) big = larger(big, load(r.scale + e));
    const float largest = lanes_max(big), step = largest / 32767.f;
    float* units = scratch<float>(kUnits, entries);  // the scales in steps
    const vec inverse = broadcast(largest > 0.f ? 32767.f / largest : 0.f);
    for (int64_t e = 0; e < entries; e += kLanes)
        store(units + e, mul(load(r.scale + e), inverse));
    int32_t* weights = scratch<int32_t>(kWeights, GQ * entries / 2);  // query i's pair (u, j)
    // at i * entries / 2 + u * J + j; and a query's p, then zeros
    const int64_t padding = entries / J + kLanes - len;
    float* padded = scratch<float>(kPadded, len + padding);
    for (int64_t t = len; t < len + padding; ++t) padded[t] = 0.f;
    float shares[GQ][kChunks];  // sum over t of p * zero point, a query and group
    const lane_index spread = lanes_over(__builtin_ctzll(J));  // lane l: token l / J
    for (int i = 0; i < GQ; ++i) {
        std::memcpy(padded, p + i * len, len * sizeof(float));
        int32_t* out = weights + i * entries / 2;
        vec zeros = zero();  // lane l: group l % J's share
        for (int64_t e = 0; e < entries; e += 2 * kLanes) {
            const vec p0 = permute(spread, load(padded + e / J));
            const vec p1 = permute(spread, load(padded + (e + kLanes) / J));
            zeros = fmadd(p1, load(r.zero + e + kLanes), fmadd(p0, load(r.zero + e), zeros));
            store_words(reinterpret_cast<int16_t*>(out + e / 2),
                        paired_words(narrow(rounded(mul(p0, load(units + e))),
                                            rounded(mul(p1, load(units + e + kLanes)))),
                                     J));
        }
        float lanes[kLanes];
        store(lanes, zeros);
        for (int64_t j = 0; j < J; ++j) shares[i][j] = 0.f;
        for (int64_t l = 0; l < kLanes; ++l) shares[i][l % J] += lanes[l];
    }
    for (int64_t c0 = 0; c0 < hs; c0 += 2 * kLanes) {
        const int64_t j = c0 / G;
        ivec acc[GQ][2];  // even channels c0 + 2m, odd ones c0 + 2m + 1
        for (int i = 0; i < GQ; ++i) acc[i][0] = acc[i][1] = izero();
        const auto add = [&](int64_t u, const uint8_t* a, const uint8_t* b)
                             __attribute__((always_inline)) {
            const ivec x = byte_pairs(a + c0 / 2, b + c0 / 2);
            const ivec even = low_nibbles(x), odd = high_nibbles(x);
            for (int i = 0; i < GQ; ++i) {
                const ivec w = broadcast_int(weights[i * entries / 2 + u * J + j]);
                acc[i][0] = add_ints(acc[i][0], dot_pairs(even, w));
                acc[i][1] = add_ints(acc[i][1], dot_pairs(odd, w));
            }
        };
        for (int64_t u = 0; u < len / 2; ++u) {
            const uint8_t* a = r.codes + 2 * u * r.width;
            if (c0 == 0) lines(a + kAhead * r.width, 2 * r.width);
            add(u, a, a + r.width);
        }
        if (len % 2) {  // the last token pairs with itself, its partner's weight 0
            const uint8_t* a = r.codes + (len - 1) * r.width;
            add(len / 2, a, a);
        }
        for (int i = 0; i < GQ; ++i) {
            float even[kLanes], odd[kLanes];
            store(even, mul(floats(acc[i][0]), broadcast(step)));
            store(odd, mul(floats(acc[i][1]), broadcast(step)));
            float* out = acc_out + i * hs + c0;
            for (int64_t m = 0; m < kLanes; ++m) {
                out[2 * m] = even[m] + shares[i][j];
                out[2 * m + 1] = odd[m] + shares[i][j];
            }
        }
    }
}

// `value_sums` with as many vectors of channels at a time as the registers hold beside GQ
// weights and a value: 4 in AVX-512's 32 registers; in AVX2's 16, 4 for up to 3 queries (all
// 16 registers at 3: each pass over the block reads the rows from the caches again, which
// cost more than a spill), 2 for 4.
template <int GQ, class Reader>
void sized_values(const Reader& r, int64_t len, const float* p, int64_t hs, float* acc_out) {
    constexpr int NC = kLanes == 16 || GQ <= 3 ? 4 : 2;
    if constexpr (word_valued<Reader>)
        if (values_in_words(hs, r.J)) return word_values<GQ>(r, len, p, hs, acc_out);
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
    float* scores = scratch<float>(kScores, g * len);
    by_queries(g, [&](auto GQ, int64_t i) { keys(GQ, i, scores + i * len); });
    block_softmax(scores, g, len, hs, m_out, l_out, acc_out);
    by_queries(g, [&](auto GQ, int64_t i) {
        sized_values<decltype(GQ)::value>(values, len, scores + i * len, hs, acc_out + i * hs);
    });
}


// Floats of n float16 numbers (scales and zero points), zeros after them for the whole-vector
// loads past the last (`Codes`' one vector, `word_values`' whole pairs of vectors and a token).
inline const float* widened(const _Float16* x, int64_t n, Slot slot) {
    float* out = scratch<float>(slot, n + 3 * kLanes);
    int64_t e = 0;
    for (; e + kLanes <= n; e += kLanes)
        store(out + e, widen<kF16>(reinterpret_cast<const char*>(x + e)));
    for (; e < n; ++e) out[e] = static_cast<float>(x[e]);
    for (; e < n + 3 * kLanes; ++e) out[e] = 0.f;
    return out;
}

// Scores of 8-bit per-token keys in groups of 32 (a scale and zero point a group, J a token,
// widened to float32) for GQ queries from qr (rows of HS): k = c * scale + zero a group, so
// q . k = the sum over groups of scale * (q . c) + zero * sum(q), q . c in words.
template <int GQ, int HS>
void token_word_scores(const uint8_t* kc, const float* ks, const float* kz, int64_t len,
                       const float* qr, float* s) {
    constexpr int64_t J = HS / 32;
    int16_t w[GQ * HS];
    float step[GQ];
    query_words<GQ>(qr, HS, 8, w, step);
    word_dots<GQ, HS, 8, 32>(kc, 0, len, w, ks, s, len);
    for (int i = 0; i < GQ; ++i) {
        float sum[J] = {};
        for (int64_t j = 0; j < J; ++j)
            for (int64_t d = 0; d < 32; ++d) sum[j] += qr[i * HS + j * 32 + d];
        float* out = s + i * len;
        for (int64_t t = 0; t < len; ++t) {
            float offset = 0.f;
            for (int64_t j = 0; j < J; ++j) offset += kz[t * J + j] * sum[j];
            out[t] = out[t] * step[i] + offset;
        }
    }
}

// `block` on this path: tokens a .. b - 1 of cache row `row`, groups of GS (or G, GS = 0).
template <int bits, int GS>
void grouped_block(const float* q, const Cache& c, int64_t row, int64_t a, int64_t b,
                   int64_t g, int64_t hs, int64_t G, bool key_channels, float* m, float* l,
                   float* acc) {
    const int64_t len = b - a, width = hs * bits / 8, J = hs / G;
    const float* qr = q + row * g * hs;
    const Codes<bits, true, GS> values{c.vc + row * c.vc_row + a * width, width, J, G,
                                       widened(c.vs + row * c.vs_row + a * J, len * J,
                                               kValueScales),
                                       widened(c.vz + row * c.vs_row + a * J, len * J,
                                               kValueZeros)};

    const uint8_t* kc = c.kc + row * c.kc_row + a * width;
    // the keys' integer path where it applies (`word_dots`), else their codes read as floats
    // (per-token ones at 256, Gemma 3's, four queries a KV head: as fast as the float path,
    // their sums and partial sums more than AVX2's registers hold)
    const bool in_words = key_channels ? (hs == 64 || hs == 128 || hs == 256) &&
                                             (bits == 8 || bits == 4)
                                       : (hs == 64 || hs == 128) && bits == 8 && GS == 32;
    if (!key_channels) {  // per-token keys: dequantised as read, like the values, or in words
        const float* ks = widened(c.ks + row * c.ks_row + a * J, len * J, kKeyScales);
        const float* kz = widened(c.kz + row * c.ks_row + a * J, len * J, kKeyZeros);
        if (in_words)
            return partial([&](auto GQ, int64_t i, float* s) {
                constexpr int n = decltype(GQ)::value;
                const float* qi = qr + i * hs;
                if (hs == 64) token_word_scores<n, 64>(kc, ks, kz, len, qi, s);
                else token_word_scores<n, 128>(kc, ks, kz, len, qi, s);
            }, values, g, len, hs, m, l, acc);
        const Codes<bits, true, GS> keys{kc, width, J, G, ks, kz};
        return partial([&](auto GQ, int64_t i, float* s) {
            sized_scores<decltype(GQ)::value>(keys, 0, len, qr + i * hs, hs, s, len);
        }, values, g, len, hs, m, l, acc);
    }
    // per-channel keys: the codes as they are, times the query scaled by the scales of
    // their group of G tokens, plus the query's dot product with the group's zero points
    const Codes<bits, false> keys{kc, width, J, G, nullptr, nullptr};
    partial([&](auto GQ, int64_t i, float* s) {
        constexpr int n = decltype(GQ)::value;
        float* qs = scratch<float>(kQuery, n * hs);
        int16_t* w = scratch<int16_t>(kQuery, n * hs);  // qs in words, on the integer path
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
                    store(qs + k * hs + d,
                          mul(qd, widen<kF16>(reinterpret_cast<const char*>(sc + d))));
                    off = fmadd(qd, widen<kF16>(reinterpret_cast<const char*>(ze + d)), off);
                }
                offset[k] = lanes_total(off);
            }
            float step[n];
            for (int k = 0; k < n; ++k) step[k] = 1.f;
            if constexpr (bits == 8 || bits == 4) {  // in_words: the scaled query in words
                if (in_words) {
                    query_words<n>(qs, hs, bits, w, step);
                    const int64_t u0 = t0 - a, u1 = t1 - a;  // the group's tokens in the block
                    if (hs == 64) word_dots<n, 64, bits, 64>(kc, u0, u1, w, nullptr, s, len);
                    else if (hs == 128)
                        word_dots<n, 128, bits, 128>(kc, u0, u1, w, nullptr, s, len);
                    else word_dots<n, 256, bits, 256>(kc, u0, u1, w, nullptr, s, len);
                }
            }
            if (!in_words) sized_scores<n>(keys, t0 - a, t1 - a, qs, hs, s, len);
            for (int k = 0; k < n; ++k)
                for (int64_t t = t0 - a; t < t1 - a; ++t)
                    s[k * len + t] = s[k * len + t] * step[k] + offset[k];
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
