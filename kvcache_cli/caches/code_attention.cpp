// One decoding token's attention over a quantised cache's codes, read as codes.
//
// Built at first use by `caches/code_attention.py` (c++ -O3 -march=native -fopenmp), called
// through ctypes: plain C arguments, no torch headers. Where the CPU has AVX-512 or AVX2 the
// blocks run `code_attention_simd.h`'s vector code (its head of file says what it changes and
// why); the plain loops below run elsewhere, on shapes it does not take, and built with
// -DCODE_ATTENTION_SCALAR (tests compare them).
//
// `attend_decode` does the same over a static cache's buffers (float32, or fp16 or bf16, 2
// bytes a number), a whole decoding step of one layer in one call: the new token's key and
// value written in, each row widened to float32 as it is read (F16C's vcvtph2ps where the
// CPU has it; bf16 is float32's top half, a shift), every product and sum in float32, the
// softmax finished.
//
// For each row b * nkv + h of the cache and each of its g query heads, over the n quantised
// tokens and, where the caller passes them, the full-precision sinks and tail (float32,
// fp16 or bf16 rows, read as `attend_decode` reads its own): the softmax's partial sums as
// flash-decoding keeps them, m = the largest score, l = sum exp(score - m) and
// acc = sum exp(score - m) * v, so y = acc / l, or the caller merges them with its own
// scores exactly (a rotated cache's codes are read with a rotated query, its tail is not).
//
// Codes are affine, x = c * scale + zero (quantized.py's layout): values per token, a scale
// and zero per G channels; keys per token likewise, or per channel (KIVI), a scale and zero
// per channel and G tokens. A per-token key is dequantised as it is read (hs multiply-adds,
// then one dot product a query); per-channel key scales fold into the query once per G
// tokens, and value scales into the weights. (The vector path multiplies the common keys and
// 4-bit values in integers, its head of file says how.) Codes are packed 8 / bits to a byte,
// the first in the lowest bits. Work is split over (row, block of tokens), so 2 threads share
// 3 KV heads evenly; the blocks' partial sums are merged at the end.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#include "attention_common.h"

constexpr int64_t kBlock = 512;  // tokens a work item covers, at most
constexpr int64_t kLeastBlock = 128;  // ... and at least, where a row is split for the threads

template <int bits>
inline void unpack_row(const uint8_t* packed, float* out, int64_t hs) {
    if constexpr (bits == 8) {
        for (int64_t d = 0; d < hs; ++d) out[d] = static_cast<float>(packed[d]);
    } else {
        constexpr int per = 8 / bits, mask = (1 << bits) - 1;
        for (int64_t i = 0; i < hs / per; ++i) {
            const int byte = packed[i];
            for (int k = 0; k < per; ++k) out[i * per + k] = static_cast<float>((byte >> (k * bits)) & mask);
        }
    }
}

#include "code_attention_simd.h"  // the vector path, where the CPU has AVX-512 or AVX2
#ifdef CODE_ATTENTION_SIMD
static_assert(kBlock <= 4369, "word_values' 32-bit sums of a block");
#endif

// HS and GS, when not 0, fix the head size and group size at compile time: the common
// shapes' loops are then unrolled whole (a runtime length made them 2-3x slower).
template <int bits, int HS, int GS>
void block(const float* q, const Cache& c, int64_t row, int64_t a, int64_t b, int64_t g,
           int64_t hs_, int64_t G_, bool key_channels, float* m_out, float* l_out,
           float* acc_out) {
    const int64_t hs = HS ? HS : hs_, G = GS ? GS : G_;
    const int64_t width = hs * bits / 8, J = hs / G, len = b - a;
    std::vector<float> scores(g * len), code(hs), qs(g * hs), offset(g), zacc(g * J, 0.f);
    const uint8_t* kc = c.kc + row * c.kc_row;
    const uint8_t* vc = c.vc + row * c.vc_row;
    const _Float16* ks = c.ks + row * c.ks_row;
    const _Float16* kz = c.kz + row * c.ks_row;
    const _Float16* vs = c.vs + row * c.vs_row;
    const _Float16* vz = c.vz + row * c.vs_row;
    const float* qr = q + row * g * hs;
    int64_t group = -1;
    for (int64_t t = a; t < b; ++t) {
        unpack_row<bits>(kc + t * width, code.data(), hs);
        if (key_channels) {
            if (t / G != group) {  // the query scaled by this group's channels, once per G tokens
                group = t / G;
                const _Float16* sc = ks + group * hs;
                const _Float16* ze = kz + group * hs;
                for (int64_t i = 0; i < g; ++i) {
                    float off = 0.f;
                    for (int64_t d = 0; d < hs; ++d) {
                        qs[i * hs + d] = qr[i * hs + d] * static_cast<float>(sc[d]);
                        off += qr[i * hs + d] * static_cast<float>(ze[d]);
                    }
                    offset[i] = off;
                }
            }
            for (int64_t i = 0; i < g; ++i) {
                float s = offset[i];
                for (int64_t d = 0; d < hs; ++d) s += qs[i * hs + d] * code[d];
                scores[i * len + t - a] = s;
            }
        } else {
            // the key dequantised once (hs multiply-adds), then one dot product a query: a
            // dot product a group and query reduced across lanes as often again
            for (int64_t j = 0; j < J; ++j) {
                const float sc = static_cast<float>(ks[t * J + j]);
                const float ze = static_cast<float>(kz[t * J + j]);
                for (int64_t d = 0; d < G; ++d) code[j * G + d] = code[j * G + d] * sc + ze;
            }
            for (int64_t i = 0; i < g; ++i) {
                float s = 0.f;
                for (int64_t d = 0; d < hs; ++d) s += qr[i * hs + d] * code[d];
                scores[i * len + t - a] = s;
            }
        }
    }
    block_softmax(scores.data(), g, len, hs, m_out, l_out, acc_out);
    for (int64_t t = a; t < b; ++t) {
        unpack_row<bits>(vc + t * width, code.data(), hs);
        for (int64_t i = 0; i < g; ++i) {
            const float p = scores[i * len + t - a];
            float* acc = acc_out + i * hs;
            for (int64_t j = 0; j < J; ++j) {
                const float w = p * static_cast<float>(vs[t * J + j]);
                for (int64_t d = 0; d < G; ++d) acc[j * G + d] += w * code[j * G + d];
                zacc[i * J + j] += p * static_cast<float>(vz[t * J + j]);
            }
        }
    }
    for (int64_t i = 0; i < g; ++i)
        for (int64_t j = 0; j < J; ++j)
            for (int64_t d = 0; d < G; ++d) acc_out[i * hs + j * G + d] += zacc[i * J + j];
}

template <int bits>
void sized(const float* q, const Cache& c, int64_t row, int64_t a, int64_t b, int64_t g,
           int64_t hs, int64_t G, bool key_channels, float* m, float* l, float* acc) {
#ifdef CODE_ATTENTION_SIMD
    if (hs % simd::kLanes == 0 && hs <= simd::kLanes * simd::kChunks &&
        (G % simd::kLanes == 0 || simd::kLanes % G == 0))
        return simd::codes_block<bits>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
#endif
    if (hs == 64 && G == 32) block<bits, 64, 32>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
    else if (hs == 64 && G == 64) block<bits, 64, 64>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
    else if (hs == 128 && G == 32) block<bits, 128, 32>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
    else if (hs == 128 && G == 64) block<bits, 128, 64>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
    else if (hs == 128 && G == 128) block<bits, 128, 128>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
    else block<bits, 0, 0>(q, c, row, a, b, g, hs, G, key_channels, m, l, acc);
}

// Tokens a block covers: kBlock, or a row's share of the threads where that is less (down to
// kLeastBlock), so that no thread waits on a row of one block (each of Gemma 3's rings is a
// row of 512 slots: one block, one thread). It depends on the row's length and the threads,
// not on the rows: a batch's row sums in the order of the same row alone.
inline int64_t block_tokens(const std::vector<int64_t>& lengths, int64_t threads) {
    int64_t n = 0;
    for (const int64_t length : lengths) n += length;
    const int64_t share = (n + threads - 1) / threads;
    const int64_t block = (share + 15) / 16 * 16;
    return block > kBlock ? kBlock : block < kLeastBlock ? kLeastBlock : block;
}

// Every (row, segment, block of `block_tokens`) item's partial sums by
// `part(row, segment, a, b, m, l, acc)`, over 2 threads or more, then each row's blocks merged
// into m_out, l_out, acc_out. A segment is a run of tokens read alike: `attend_codes`' codes,
// sinks and tail; lengths[i] tokens in segment i.
template <class Part>
void over_blocks(int64_t rows, const std::vector<int64_t>& lengths, int64_t g, int64_t hs,
                 int64_t threads, Part part, float* m_out, float* l_out, float* acc_out) {
    const int64_t block = block_tokens(lengths, threads);
    std::vector<int64_t> seg, first;  // each block of a row: its segment and first token
    for (size_t i = 0; i < lengths.size(); ++i)
        for (int64_t a = 0; a < lengths[i]; a += block) {
            seg.push_back(static_cast<int64_t>(i));
            first.push_back(a);
        }
    const int64_t blocks = static_cast<int64_t>(seg.size()), items = rows * blocks;
    std::vector<float> m(items * g), l(items * g), acc(items * g * hs);
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t row = item / blocks, k = item % blocks, a = first[k];
        const int64_t b = a + block < lengths[seg[k]] ? a + block : lengths[seg[k]];
        part(row, seg[k], a, b, m.data() + item * g, l.data() + item * g,
             acc.data() + item * g * hs);
    }
    for (int64_t row = 0; row < rows; ++row)  // the blocks' partial sums, merged
        for (int64_t i = 0; i < g; ++i) {
            float M = -INFINITY;
            for (int64_t k = 0; k < blocks; ++k) M = std::fmax(M, m[(row * blocks + k) * g + i]);
            float L = 0.f;
            float* out = acc_out + (row * g + i) * hs;
            for (int64_t d = 0; d < hs; ++d) out[d] = 0.f;
            for (int64_t k = 0; k < blocks; ++k) {
                const int64_t at = (row * blocks + k) * g + i;
                const float w = std::exp(m[at] - M);
                L += w * l[at];
                for (int64_t d = 0; d < hs; ++d) out[d] += w * acc[at * hs + d];
            }
            m_out[row * g + i] = M;
            l_out[row * g + i] = L;
        }
}

// The partial sums of g queries over stored tokens a .. b - 1 of one cache row.
template <int fmt, int HS>
void half_block(const float* q, const void* k_, const void* v_, int64_t a, int64_t b,
                int64_t g, int64_t hs_, float* m_out, float* l_out, float* acc_out) {
    const int64_t hs = HS ? HS : hs_, len = b - a, bytes = hs * kBytes<fmt>;
    const char* k = static_cast<const char*>(k_);
    const char* v = static_cast<const char*>(v_);
    std::vector<float> scores(g * len), x(hs);
    for (int64_t t = a; t < b; ++t) {
        widen_row<fmt>(k + t * bytes, x.data(), hs);
        for (int64_t i = 0; i < g; ++i) {
            float s = 0.f;
            for (int64_t d = 0; d < hs; ++d) s += q[i * hs + d] * x[d];
            scores[i * len + t - a] = s;
        }
    }
    block_softmax(scores.data(), g, len, hs, m_out, l_out, acc_out);
    for (int64_t t = a; t < b; ++t) {
        widen_row<fmt>(v + t * bytes, x.data(), hs);
        for (int64_t i = 0; i < g; ++i) {
            const float p = scores[i * len + t - a];
            float* acc = acc_out + i * hs;
            for (int64_t d = 0; d < hs; ++d) acc[d] += p * x[d];
        }
    }
}

template <int fmt>
void half_sized(const float* q, const void* k, const void* v, int64_t a, int64_t b, int64_t g,
                int64_t hs, float* m, float* l, float* acc) {
#ifdef CODE_ATTENTION_SIMD
    if (hs % simd::kLanes == 0) return simd::stored_block<fmt>(q, k, v, a, b, g, hs, m, l, acc);
#endif
    if (hs == 64) half_block<fmt, 64>(q, k, v, a, b, g, hs, m, l, acc);
    else if (hs == 128) half_block<fmt, 128>(q, k, v, a, b, g, hs, m, l, acc);
    else half_block<fmt, 0>(q, k, v, a, b, g, hs, m, l, acc);
}

// Row `row` of stored keys and values, `stride` elements apart, in format fmt.
void stored_block(int64_t fmt, const float* q, const void* k, const void* v, int64_t stride,
                  int64_t row, int64_t a, int64_t b, int64_t g, int64_t hs, float* m, float* l,
                  float* acc) {
    const int64_t at = row * stride * (fmt == kF32 ? 4 : 2);  // bytes to the row
    const char* kr = static_cast<const char*>(k) + at;
    const char* vr = static_cast<const char*>(v) + at;
    if (fmt == kF32) half_sized<kF32>(q, kr, vr, a, b, g, hs, m, l, acc);
    else if (fmt == kBF16) half_sized<kBF16>(q, kr, vr, a, b, g, hs, m, l, acc);
    else half_sized<kF16>(q, kr, vr, a, b, g, hs, m, l, acc);
}

// Every row's partial sums over its n codes, s sinks and t tail tokens (both of format fmt, a
// row's tokens contiguous, sink_row / tail_row elements from one row to the next): the pass
// `attend_codes` and `decode_codes` share.
void over_codes(const float* q, const Cache& c, int64_t rows, int64_t n, int64_t g, int64_t hs,
                int64_t bits, int64_t G, bool key_channels, int64_t threads, const void* sink_k,
                const void* sink_v, int64_t sink_row, int64_t s, const void* tail_k,
                const void* tail_v, int64_t tail_row, int64_t t, int64_t fmt, float* m_out,
                float* l_out, float* acc_out) {
    over_blocks(rows, {n, s, t}, g, hs, threads, [&](int64_t row, int64_t seg, int64_t a,
                                                      int64_t b, float* mo, float* lo,
                                                      float* ao) {
        if (seg == 1)
            stored_block(fmt, q + row * g * hs, sink_k, sink_v, sink_row, row, a, b, g, hs, mo,
                         lo, ao);
        else if (seg == 2)
            stored_block(fmt, q + row * g * hs, tail_k, tail_v, tail_row, row, a, b, g, hs, mo,
                         lo, ao);
        else if (bits == 8) sized<8>(q, c, row, a, b, g, hs, G, key_channels, mo, lo, ao);
        else if (bits == 4) sized<4>(q, c, row, a, b, g, hs, G, key_channels, mo, lo, ao);
        else sized<2>(q, c, row, a, b, g, hs, G, key_channels, mo, lo, ao);
    }, m_out, l_out, acc_out);
}

}  // namespace

// full: the sinks' and the tail's keys and values (rows, s or t, hs) at full precision, format
// fmt, a row's tokens contiguous, sink_row / tail_row elements from one row to the next; they
// join the codes' partial sums in the same pass (s = t = 0: the codes alone).
extern "C" int attend_codes(const float* q, const uint8_t* kc, const _Float16* ks,
                            const _Float16* kz, const uint8_t* vc, const _Float16* vs,
                            const _Float16* vz, int64_t kc_row, int64_t vc_row, int64_t ks_row,
                            int64_t vs_row, int64_t rows, int64_t n, int64_t g, int64_t hs,
                            int64_t bits, int64_t G, int64_t key_channels, int64_t threads,
                            const void* sink_k, const void* sink_v, int64_t sink_row, int64_t s,
                            const void* tail_k, const void* tail_v, int64_t tail_row, int64_t t,
                            int64_t fmt, float* m_out, float* l_out, float* acc_out) {
    if (bits != 8 && bits != 4 && bits != 2) return 1;
    const Cache c{kc, vc, ks, kz, vs, vz, kc_row, vc_row, ks_row, vs_row};
    over_codes(q, c, rows, n, g, hs, bits, G, key_channels, threads, sink_k, sink_v, sink_row,
               s, tail_k, tail_v, tail_row, t, fmt, m_out, l_out, acc_out);
    return 0;
}

namespace {

// One row of hs float32 numbers stored in format fmt, rounded to nearest, ties to even, as
// torch's cast rounds (a float16 conversion does; bfloat16 is float32's top half, rounded by
// hand, a NaN kept a quiet NaN as torch keeps it).
void store_row(int64_t fmt, const float* x, void* out, int64_t hs) {
    if (fmt == kF32) {
        std::memcpy(out, x, hs * sizeof(float));
    } else if (fmt == kF16) {
        _Float16* h = static_cast<_Float16*>(out);
        for (int64_t d = 0; d < hs; ++d) h[d] = static_cast<_Float16>(x[d]);
    } else {
        uint16_t* h = static_cast<uint16_t*>(out);
        for (int64_t d = 0; d < hs; ++d) {
            uint32_t u;
            std::memcpy(&u, x + d, sizeof u);
            h[d] = (u & 0x7fffffffu) > 0x7f800000u
                       ? 0x7fc0
                       : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    }
}

// The queries q (B, nh, hs), element [b, h, d] at b * q_b + h * q_h + d, times 1 / sqrt(hs),
// contiguous: query head h of batch row b at (b * nh + h) * hs, so cache row b * nkv + h'
// finds its g queries together.
std::vector<float> scaled_queries(const float* q, int64_t q_b, int64_t q_h, int64_t B,
                                  int64_t nh, int64_t hs) {
    std::vector<float> qs(B * nh * hs);
    const float scale = 1.f / std::sqrt(static_cast<float>(hs));
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < nh; ++h)
            for (int64_t d = 0; d < hs; ++d)
                qs[(b * nh + h) * hs + d] = q[b * q_b + h * q_h + d] * scale;
    return qs;
}

}  // namespace

// A decoding step's attention for one new token a row, B rows at the same position `start`
// (a static cache's step), in one call instead of 26 to 28 torch ops a layer:
// the token's keys and values k, v (B, nkv, hs) and queries q (B, nh, hs), each a view of
// the q|k|v product (element [b, h, d] at b * x_b + h * x_h + d), the keys and values
// written into the buffers (B, nkv, slots, hs), contiguous, of format fmt, at slot `start`;
// then each query head h, scaled by 1 / sqrt(hs), over slots 0 .. start of KV head
// h / (nh / nkv), the partial sums finished (acc / l) into y (B, nh, hs). The position is
// read from memory (*at, the step's positions), not passed: a replayed step's calls are the
// same at every position (`generate.ReplayedDecode`). With `ring`, the buffers are a sliding
// window's ring of `slots` (no sinks, no spare slots): the token goes to slot start % slots
// and the queries read the min(start + 1, slots) filled ones, which hold exactly the window
// (the order of the keys is nothing to attention).
extern "C" int attend_decode(const float* q, int64_t q_b, int64_t q_h, const float* k,
                             int64_t k_b, int64_t k_h, const float* v, int64_t v_b,
                             int64_t v_h, void* k_buf, void* v_buf, int64_t slots, int64_t fmt,
                             int64_t B, int64_t nh, int64_t nkv, int64_t hs,
                             const int64_t* at, int64_t ring, int64_t threads, float* y) {
    const int64_t position = *at;
    if (fmt < kF16 || fmt > kF32 || position < 0 || (!ring && position >= slots) || nh % nkv)
        return 1;
    // the token's slot, and the last slot the queries read
    const int64_t start = ring && position >= slots ? slots - 1 : position;
    const int64_t slot = ring ? position % slots : position;
    const int64_t g = nh / nkv, rows = B * nkv, stride = slots * hs;  // elements a cache row
    const int64_t bytes = fmt == kF32 ? 4 : 2;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = r / nkv, h = r % nkv, at = (r * stride + slot * hs) * bytes;
        store_row(fmt, k + b * k_b + h * k_h, static_cast<char*>(k_buf) + at, hs);
        store_row(fmt, v + b * v_b + h * v_h, static_cast<char*>(v_buf) + at, hs);
    }
    // row b * nkv + h's g queries
    const std::vector<float> qs = scaled_queries(q, q_b, q_h, B, nh, hs);
    std::vector<float> m(B * nh), l(B * nh);
    // query head h of row b is query i = h % g of cache row b * nkv + h / g: the partial sums'
    // (row * g + i) * hs is y's (b * nh + h) * hs
    over_blocks(rows, {start + 1}, g, hs, threads, [&](int64_t r, int64_t, int64_t a,
                                                        int64_t b, float* mo, float* lo,
                                                        float* ao) {
        stored_block(fmt, qs.data() + r * g * hs, k_buf, v_buf, stride, r, a, b, g, hs, mo, lo,
                     ao);
    }, m.data(), l.data(), y);
    for (int64_t i = 0; i < B * nh; ++i)
        for (int64_t d = 0; d < hs; ++d) y[i * hs + d] /= l[i];
    return 0;
}

// Per-token affine codes of new tokens, written where the cache keeps them: quantized.py's
// `quantise` and `pack` in one pass, bit for bit, so a decoding step stores its token in
// one call instead of some twenty small torch ops a layer. The same float32 operations in
// the same order; compiled without fast math here, whose reciprocals (x * (1 / s) for
// x / s) would move a code by one now and then.
#ifdef __clang__
#pragma float_control(precise, on, push)
#define EXACT_MATH
#else
#define EXACT_MATH __attribute__((optimize("no-fast-math")))
#endif

namespace {

// numpy's and torch's nextafter on a float16, from h one step towards `to`.
EXACT_MATH inline _Float16 half_towards(_Float16 h, _Float16 to) {
    if (h == to) return to;
    uint16_t b;
    std::memcpy(&b, &h, sizeof b);
    const bool negative = b & 0x8000, zero = (b & 0x7fff) == 0;
    if (zero) b = to > h ? 0x0001 : 0x8001;  // the smallest subnormal of to's sign
    else if ((to > h) != negative) ++b;      // away from zero
    else --b;                                // towards zero
    std::memcpy(&h, &b, sizeof b);
    return h;
}

// One group of G numbers: its codes (unpacked), scale and zero point.
EXACT_MATH void quantise_group(const float* x, int64_t G, int levels, uint8_t* q, _Float16* scale,
                               _Float16* zero) {
    float lo = x[0], hi = x[0];
    for (int64_t d = 1; d < G; ++d) {
        lo = x[d] < lo ? x[d] : lo;
        hi = x[d] > hi ? x[d] : hi;
    }
    _Float16 z = static_cast<_Float16>(lo);
    if (static_cast<float>(z) > lo) z = half_towards(z, static_cast<_Float16>(-65504.f));
    const float zf = static_cast<float>(z);
    float span = (hi - zf) / static_cast<float>(levels);
    span = span < 0x1p-24f ? 0x1p-24f : span;  // float16's smallest step
    _Float16 s = static_cast<_Float16>(span);
    if (static_cast<float>(s) < span) s = half_towards(s, static_cast<_Float16>(65504.f));
    const float sf = static_cast<float>(s);
    for (int64_t d = 0; d < G; ++d) {
        float c = std::nearbyint((x[d] - zf) / sf);  // to nearest, ties to even: torch's round
        c = c < 0.f ? 0.f : (c > levels ? static_cast<float>(levels) : c);
        q[d] = static_cast<uint8_t>(c);
    }
    *scale = s;
    *zero = z;
}

// One token's hs numbers x: J = hs / G groups' codes packed into `codes` (hs * bits / 8
// bytes), their scales and zero points into scale[0 .. J), zero[0 .. J).
// A token's hs codes q (unpacked) packed 8 / bits a byte into `codes`, the first lowest.
void pack_codes(const uint8_t* q, int64_t hs, int bits, uint8_t* codes) {
    const int per = 8 / bits;
    for (int64_t i = 0; i < hs * bits / 8; ++i) {
        int byte = 0;
        for (int k = 0; k < per; ++k) byte |= q[i * per + k] << (k * bits);
        codes[i] = static_cast<uint8_t>(byte);
    }
}

EXACT_MATH void quantise_token(const float* x, int64_t hs, int bits, int64_t G, uint8_t* codes,
                               _Float16* scale, _Float16* zero) {
    const int levels = (1 << bits) - 1;
    uint8_t q[1024];  // a head's codes, unpacked: head sizes up to 1,024 (checked)
    for (int64_t j = 0; j < hs / G; ++j)
        quantise_group(x + j * G, G, levels, q + j * G, scale + j, zero + j);
    pack_codes(q, hs, bits, codes);
}

// C tokens' keys x (C rows of hs) quantised per channel, KIVI's groups (`_Channels.encode`):
// channel d's C numbers one group, its scale and zero point at scale[d], zero[d]; each
// token's codes packed into its row of `codes`, `width` bytes apart.
EXACT_MATH void quantise_channels(const float* x, int64_t C, int64_t hs, int bits,
                                  uint8_t* codes, int64_t width, _Float16* scale,
                                  _Float16* zero) {
    const int levels = (1 << bits) - 1;
    std::vector<float> column(C);
    std::vector<uint8_t> q(C * hs), q_column(C);  // (C, hs) unpacked
    for (int64_t d = 0; d < hs; ++d) {
        for (int64_t c = 0; c < C; ++c) column[c] = x[c * hs + d];
        quantise_group(column.data(), C, levels, q_column.data(), scale + d, zero + d);
        for (int64_t c = 0; c < C; ++c) q[c * hs + d] = q_column[c];
    }
    for (int64_t c = 0; c < C; ++c) pack_codes(q.data() + c * hs, hs, bits, codes + c * width);
}

bool quantisable(int64_t bits, int64_t hs, int64_t G) {
    return (bits == 8 || bits == 4 || bits == 2) && G > 0 && hs % G == 0 && hs <= 1024;
}

}  // namespace

// x (rows, T, hs) float32, a row's tokens contiguous, x_row elements from one row to the next;
// codes (rows, T, hs * bits / 8) and scale, zero (rows, T, hs / G) likewise, c_row, s_row and
// z_row apart: each group of G numbers of a token quantised to bits, packed 8 / bits a byte.
extern "C" EXACT_MATH int quantise_tokens(const float* x, int64_t x_row, int64_t rows, int64_t T,
                                          int64_t hs, int64_t bits, int64_t G, uint8_t* codes,
                                          int64_t c_row, _Float16* scale, int64_t s_row,
                                          _Float16* zero, int64_t z_row) {
    if (!quantisable(bits, hs, G)) return 1;
    const int64_t width = hs * bits / 8, J = hs / G;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t t = 0; t < T; ++t)
            quantise_token(x + r * x_row + t * hs, hs, static_cast<int>(bits), G,
                           codes + r * c_row + t * width, scale + r * s_row + t * J,
                           zero + r * z_row + t * J);
    return 0;
}

#ifdef __clang__
#pragma float_control(pop)
#endif

// A quantised cache's decoding step of one layer in one call, as `attend_decode` is a static
// cache's: the new token's keys and values k, v (B, nkv, hs) written where the cache keeps
// them, by `write`: kWriteAt where its position puts them, read from memory (*at, the step's
// positions), so that a replayed step's calls are the same at every position
// (`generate.ReplayedDecode`): quantised at once, or into the tail, a chunk that fills
// leaving the tail in the same call (`place_token`); kWriteNone already stored by the
// caller. Then the queries q (B, nh, hs), scaled by 1 / sqrt(hs), over codes, sinks and tail
// (as `attend_codes` reads them), query head h on KV head h / (nh / nkv), the softmax
// finished into y (B, nh, hs).
// q, k, v: views of the q|k|v product, element [b, h, d] at b * x_b + h * x_h + d.
enum Write { kWriteNone = 0, kWriteAt = 1 };

// The call's arguments in one struct of 8-byte fields (code_attention.py's `DecodeArgs`, in
// the same order): ctypes converts each argument of a call, and 40 of them took as long as
// the kernel's work over a short history; a cache keeps one a layer and rewrites only what
// a step changes.
struct DecodeArgs {
    const float* q;
    int64_t q_b, q_h;
    const float* k;
    int64_t k_b, k_h;
    const float* v;
    int64_t v_b, v_h, write;
    uint8_t* kc;
    _Float16 *ks, *kz;
    uint8_t* vc;
    _Float16 *vs, *vz;
    int64_t kc_row, vc_row, ks_row, vs_row, B, nh, nkv, n, hs, bits, G, key_channels, threads;
    const void *sink_k, *sink_v;
    int64_t sink_row, s;
    void *tail_k, *tail_v;
    int64_t tail_row, t, fmt;
    float* y;
    const int64_t* at;  // kWriteAt's: the token's position, and how the cache keeps tokens:
    int64_t residual, chunk;  // the newest `residual` in the tail, the rest `chunk` at a time
};

namespace {

void widen_any(int64_t fmt, const char* row, float* out, int64_t hs) {
    if (fmt == kF32) widen_row<kF32>(row, out, hs);
    else if (fmt == kBF16) widen_row<kBF16>(row, out, hs);
    else widen_row<kF16>(row, out, hs);
}

// The new token's keys and values quantised per token into code row `row` of every cache row.
void write_codes(const DecodeArgs* a, int64_t row) {
    const int64_t width = a->hs * a->bits / 8, J = a->hs / a->G;
    for (int64_t r = 0; r < a->B * a->nkv; ++r) {
        const int64_t b = r / a->nkv, h = r % a->nkv;
        quantise_token(a->k + b * a->k_b + h * a->k_h, a->hs, static_cast<int>(a->bits), a->G,
                       a->kc + r * a->kc_row + row * width, a->ks + r * a->ks_row + row * J,
                       a->kz + r * a->ks_row + row * J);
        quantise_token(a->v + b * a->v_b + h * a->v_h, a->hs, static_cast<int>(a->bits), a->G,
                       a->vc + r * a->vc_row + row * width, a->vs + r * a->vs_row + row * J,
                       a->vz + r * a->vs_row + row * J);
    }
}

// The new token's keys and values stored in format fmt into tail row `row` of every cache
// row: the tail is the caller's buffer, written here as `attend_decode` writes its own.
void write_tail(const DecodeArgs* a, int64_t row) {
    const int64_t bytes = a->fmt == kF32 ? 4 : 2;
    for (int64_t r = 0; r < a->B * a->nkv; ++r) {
        const int64_t b = r / a->nkv, h = r % a->nkv;
        const int64_t at = (r * a->tail_row + row * a->hs) * bytes;
        store_row(a->fmt, a->k + b * a->k_b + h * a->k_h, static_cast<char*>(a->tail_k) + at,
                  a->hs);
        store_row(a->fmt, a->v + b * a->v_b + h * a->v_h, static_cast<char*>(a->tail_v) + at,
                  a->hs);
    }
}

// The chunk that leaves the tail: its first C tokens of every cache row quantised into code
// rows first .. first + C - 1 (keys per channel into key scale row first / C, KIVI's groups,
// or per token; values per token), as `QuantizedCache._flush` quantises them, and the
// tail's other `rest` tokens moved to its front.
void flush_chunk(const DecodeArgs* a, int64_t first, int64_t C, int64_t rest) {
    const int64_t hs = a->hs, bits = a->bits, width = hs * bits / 8, J = hs / a->G;
    const int64_t bytes = a->fmt == kF32 ? 4 : 2;
    std::vector<float> x(C * hs);  // (C, hs): the chunk widened to float32
    for (int64_t r = 0; r < a->B * a->nkv; ++r)
        for (const bool values : {false, true}) {
            char* tail = static_cast<char*>(values ? a->tail_v : a->tail_k) +
                         r * a->tail_row * bytes;
            for (int64_t c = 0; c < C; ++c)
                widen_any(a->fmt, tail + c * hs * bytes, x.data() + c * hs, hs);
            uint8_t* codes = values ? a->vc + r * a->vc_row : a->kc + r * a->kc_row;
            _Float16* scale = values ? a->vs + r * a->vs_row : a->ks + r * a->ks_row;
            _Float16* zero = values ? a->vz + r * a->vs_row : a->kz + r * a->ks_row;
            if (!values && a->key_channels)
                quantise_channels(x.data(), C, hs, static_cast<int>(bits), codes + first * width,
                                  width, scale + first / C * hs, zero + first / C * hs);
            else
                for (int64_t c = 0; c < C; ++c)
                    quantise_token(x.data() + c * hs, hs, static_cast<int>(bits), a->G,
                                   codes + (first + c) * width, scale + (first + c) * J,
                                   zero + (first + c) * J);
            std::memmove(tail, tail + C * hs * bytes, rest * hs * bytes);
        }
}

// kWriteAt: the token at position *at placed as `QuantizedCache` keeps tokens. Past the s
// sinks (full), m tokens with it: the codes hold the whole chunks beyond the residual,
// (m - residual) / chunk * chunk of them, the tail the rest; a chunk leaves the tail the step
// it fills. n and t: the codes and the tail tokens the step then reads. False for a position
// or layout it cannot place.
bool place_token(const DecodeArgs* a, int64_t* n, int64_t* t) {
    const int64_t m = *a->at + 1 - a->s, R = a->residual, C = a->chunk;
    if (m < 1 || R < 0 || C < 1 || (a->key_channels && C != a->G)) return false;
    const int64_t coded = m - 1 > R ? (m - 1 - R) / C * C : 0;  // before the token
    if (R == 0 && C == 1) {  // straight into the codes, as int8's default keeps them
        write_codes(a, m - 1);
        *n = m, *t = 0;
        return true;
    }
    const int64_t held = m - coded;  // the tail's tokens, this one the last
    write_tail(a, held - 1);
    if (held - R == C) {
        flush_chunk(a, coded, C, held - C);
        *n = coded + C, *t = held - C;
    } else {
        *n = coded, *t = held;
    }
    return true;
}

}  // namespace

extern "C" int decode_codes(const DecodeArgs* a) {
    const int64_t B = a->B, nh = a->nh, nkv = a->nkv, hs = a->hs, bits = a->bits;
    const int64_t G = a->G, fmt = a->fmt, write = a->write;
    int64_t n = a->n, t = a->t;
    if (!quantisable(bits, hs, G) || nh % nkv || write < kWriteNone || write > kWriteAt ||
        (write == kWriteAt && a->at == nullptr) || fmt < kF16 || fmt > kF32)
        return 1;
    if (write == kWriteAt && !place_token(a, &n, &t)) return 1;
    const int64_t g = nh / nkv, rows = B * nkv;
    // row b * nkv + h's g queries
    const std::vector<float> qs = scaled_queries(a->q, a->q_b, a->q_h, B, nh, hs);
    std::vector<float> m(B * nh), l(B * nh);
    const Cache c{a->kc, a->vc, a->ks, a->kz, a->vs, a->vz, a->kc_row, a->vc_row, a->ks_row,
                  a->vs_row};
    over_codes(qs.data(), c, rows, n, g, hs, bits, G, a->key_channels, a->threads, a->sink_k,
               a->sink_v, a->sink_row, a->s, a->tail_k, a->tail_v, a->tail_row, t, fmt, m.data(),
               l.data(), a->y);
    for (int64_t i = 0; i < B * nh; ++i)  // (row * g + i) * hs is y's (b * nh + h) * hs
        for (int64_t d = 0; d < hs; ++d) a->y[i * hs + d] /= l[i];
    return 0;
}
