// The one-token rows of a serving step, attending over a paged pool's blocks where they lie.
//
// Built at first use by `caches/paged.py` (through `caches/native.py`: c++ -O3 -march=native
// -fopenmp), called through ctypes: plain C arguments, no torch headers. vLLM's paged
// attention: each row's keys and values are read straight from the pool through the row's
// block table, where the torch path first gathers every bound row's blocks into a contiguous
// (B, nkv, S, hs) tensor (every cached key copied once more a layer and step) and then runs
// SDPA under a per-row mask.
//
// Pool layer: k, v (nkv, n_blocks, bs, hs) in float32, float16 or bfloat16, block ids
// (rows, width); row r's query sees its tokens first[r] .. last[r] (a sliding layer's window,
// or 0 .. its own position). Work is split over (row, KV head) pairs: each pair lists its
// tokens' places in the pool once (K and V share them), scores its g queries (GQA) by
// 1 / sqrt(hs), and takes the softmax's partial sums as code_attention_simd.h computes them
// for a contiguous cache, reading through the places (`Paged`); y = acc / l. Where the CPU has
// neither AVX-512 nor AVX2 (or hs is not a multiple of the vector's lanes, or built with
// -DCODE_ATTENTION_SCALAR, which the tests compare) plain loops do the same arithmetic.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#include "attention_common.h"  // the formats, e^x, a block's softmax

// Places listed past a pair's last token: the vector path prefetches rows up to
// simd::kAhead tokens ahead of a tile of up to 16 tokens (a prefetch never faults, its
// address must still be read from the list).
constexpr int64_t kPad = 64;

// The partial sums of g queries (q, g rows of hs, already scaled) over len tokens whose rows
// lie at elements off[t] of one head's keys k and values v: the plain loops.
template <int fmt>
void plain(const float* q, const char* k, const char* v, const int64_t* off, int64_t len,
           int64_t g, int64_t hs, float* m, float* l, float* acc) {
    std::vector<float> scores(g * len), x(hs);
    for (int64_t t = 0; t < len; ++t) {
        const char* row = k + off[t] * kBytes<fmt>;
        widen_row<fmt>(row, x.data(), hs);
        for (int64_t i = 0; i < g; ++i) {
            float s = 0.f;
            for (int64_t d = 0; d < hs; ++d) s += q[i * hs + d] * x[d];
            scores[i * len + t] = s;
        }
    }
    block_softmax(scores.data(), g, len, hs, m, l, acc);
    for (int64_t t = 0; t < len; ++t) {
        const char* row = v + off[t] * kBytes<fmt>;
        widen_row<fmt>(row, x.data(), hs);
        for (int64_t i = 0; i < g; ++i) {
            const float p = scores[i * len + t];
            for (int64_t d = 0; d < hs; ++d) acc[i * hs + d] += p * x[d];
        }
    }
}

}  // namespace

namespace {
#include "code_attention_simd.h"  // the vector readers and partial sums, where the CPU has them

#ifdef CODE_ATTENTION_SIMD
namespace simd {

// A reader of one head's pool rows through a pair's list of places: token t's row starts at
// element off[t] (the header's `Stored` reads row t at t * hs).
template <int fmt>
struct Paged {
    static constexpr bool unrolled = false;
    const char* head;
    const int64_t* off;
    int64_t hs;
    vec chunk(int64_t t, int64_t c) const {
        return widen<fmt>(head + (off[t] + kLanes * c) * kBytes<fmt>);
    }
    void prefetch(int64_t t) const { lines(head + off[t] * kBytes<fmt>, hs * kBytes<fmt>); }
};

template <int fmt>
void paged(const float* q, const char* k, const char* v, const int64_t* off, int64_t len,
           int64_t g, int64_t hs, float* m, float* l, float* acc) {
    const Paged<fmt> keys{k, off, hs}, values{v, off, hs};
    partial([&](auto GQ, int64_t i, float* s) {
        sized_scores<decltype(GQ)::value>(keys, 0, len, q + i * hs, hs, s, len);
    }, values, g, len, hs, m, l, acc);
}

}  // namespace simd
#endif

template <int fmt>
void pair_sums(const float* q, const char* k, const char* v, const int64_t* off, int64_t len,
               int64_t g, int64_t hs, float* m, float* l, float* acc) {
#ifdef CODE_ATTENTION_SIMD
    if (hs % simd::kLanes == 0 && hs <= simd::kLanes * simd::kChunks)
        return simd::paged<fmt>(q, k, v, off, len, g, hs, m, l, acc);
#endif
    plain<fmt>(q, k, v, off, len, g, hs, m, l, acc);
}

}  // namespace

// q: each row's nkv * g query heads (float32), q_row / q_head elements from one row / head to
// the next, a head's hs numbers contiguous; y likewise (y_row, y_head). k, v: one pool layer,
// (nkv, n_blocks, bs, hs) contiguous, format fmt. table: (rows, width) block ids; row r sees
// its tokens first[r] .. last[r]. 1: a range past the table or an entry outside the pool
// (nothing is read there, that row's y is left as it was).
extern "C" int attend_paged(const float* q, int64_t q_row, int64_t q_head, const void* k,
                            const void* v, int64_t fmt, int64_t n_blocks, int64_t bs,
                            int64_t nkv, int64_t hs, int64_t g, const int64_t* table,
                            int64_t width, const int64_t* first, const int64_t* last,
                            int64_t rows, int64_t threads, float* y, int64_t y_row,
                            int64_t y_head) {
    const int64_t bytes = fmt == kF32 ? 4 : 2, head_size = n_blocks * bs * hs * bytes;
    const float scale = 1.f / std::sqrt(static_cast<float>(hs));
    int bad = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) reduction(| : bad)
    for (int64_t item = 0; item < rows * nkv; ++item) {
        const int64_t r = item / nkv, h = item % nkv, a = first[r], len = last[r] - a + 1;
        if (a < 0 || len < 1 || last[r] >= width * bs) {
            bad = 1;
            continue;
        }
        std::vector<int64_t> off(len + kPad);  // each token's row, in elements of the head
        const int64_t* blocks = table + r * width;
        int64_t block = a / bs, slot = a % bs, t = 0;
        for (; t < len; ++t) {
            if (blocks[block] < 0 || blocks[block] >= n_blocks) break;
            off[t] = (blocks[block] * bs + slot) * hs;
            if (++slot == bs) slot = 0, ++block;
        }
        if (t < len) {
            bad = 1;
            continue;
        }
        for (; t < len + kPad; ++t) off[t] = off[len - 1];
        std::vector<float> qs(g * hs), m(g), l(g), acc(g * hs);
        for (int64_t i = 0; i < g; ++i)
            for (int64_t d = 0; d < hs; ++d)
                qs[i * hs + d] = q[r * q_row + (h * g + i) * q_head + d] * scale;
        const char* kh = static_cast<const char*>(k) + h * head_size;
        const char* vh = static_cast<const char*>(v) + h * head_size;
        if (fmt == kF32) pair_sums<kF32>(qs.data(), kh, vh, off.data(), len, g, hs, m.data(), l.data(), acc.data());
        else if (fmt == kBF16) pair_sums<kBF16>(qs.data(), kh, vh, off.data(), len, g, hs, m.data(), l.data(), acc.data());
        else pair_sums<kF16>(qs.data(), kh, vh, off.data(), len, g, hs, m.data(), l.data(), acc.data());
        for (int64_t i = 0; i < g; ++i)
            for (int64_t d = 0; d < hs; ++d)
                y[r * y_row + (h * g + i) * y_head + d] = acc[i * hs + d] / l[i];
    }
    return bad;
}
