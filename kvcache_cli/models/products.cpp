// A decode's few rows' products with a weight matrix, read once, on the CPU.
//
// Built at first use by `models/linear.py` (through `caches/native.py`), called through
// ctypes. A decode step multiplies a few rows by every matrix and does almost no arithmetic
// a weight, so its time is how fast the weights stream from memory. Each output is a dot
// product over one weight row (nn.Linear's (out, in) order, contiguous). Threads take equal
// runs of rows, so each core streams one stretch of the matrix (float16 and int8 asking a
// page ahead). A decode's one or two rows (float32's up to four) take one weight row at a
// time, one stream a thread; more rows take four weight rows at once with up to four rows of
// x, all accumulators in registers, so a weight is read from memory once for every row of x
// and a row of x once a tile (a batch of 16 is bound by loads of x, not of weights, without
// it).
// Each weight is widened to float32 in registers as it is read: int8 (times its row's
// bfloat16 scale, after the sum), float16, or float32.
//
// An output's sum is the same float32 operations whichever rows come with it and however
// the threads split the outputs: one accumulator of L lanes, the row's chunks of L added in
// order (the last zero-padded), then its lanes. So a batched decode's rows equal each one's
// solo product bit for bit. L is 16 with AVX-512 (F, BW, VL), 8 with AVX2/FMA/F16C, and 8
// in plain loops without them or built with -DPRODUCTS_SCALAR; -DPRODUCTS_AVX2 keeps to
// AVX2 on an AVX-512 CPU: the tests build all three and compare, so a machine with only
// AVX2 runs a checked path too.

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(PRODUCTS_SCALAR)
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(PRODUCTS_AVX2)
#define PRODUCTS_512 1
#else
#define PRODUCTS_256 1
#define HALF_F16C 1  // half.h's conversion by F16C
#endif
#endif

#include "half.h"

namespace {

#if defined(PRODUCTS_512)
constexpr int L = 16;
using V = __m512;
inline V zero() { return _mm512_setzero_ps(); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float lanes_sum(V v) { return _mm512_reduce_add_ps(v); }
inline void in_register(V& v) { asm("" : "+v"(v)); }  // as AVX2's, below
inline __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1); }
inline V floats(const float* p) { return _mm512_loadu_ps(p); }
inline V floats(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }

struct Int8 {
    using T = int8_t;
    static V load(const T* p) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    static V load(const T* p, int n) {  // masked: the bytes past n are never touched
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first(n), p)));
    }
};

struct Half {
    using T = uint16_t;
    static V load(const T* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static V load(const T* p, int n) {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p));
    }
};

struct Float {
    using T = float;
    static V load(const T* p) { return _mm512_loadu_ps(p); }
    static V load(const T* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
};

#else  // eight lanes: AVX2's registers, or plain loops the compiler may vectorise
constexpr int L = 8;

#if defined(PRODUCTS_256)
using V = __m256;
inline V zero() { return _mm256_setzero_ps(); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
// A chunk held in a register for every multiply-add of the tile that reads it: left to
// itself, the compiler folds its load into each one (a load a product), and loads, not
// products, then bound the tile.
inline void in_register(V& v) { asm("" : "+x"(v)); }
inline float lanes_sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
inline V floats(const float* p) { return _mm256_loadu_ps(p); }
#else
// The compiler's own vectors, lane by lane as the intrinsics are: with loops over an
// array of floats, vectorised and (under -ffast-math) reordered anew wherever they were
// inlined, a batch's rows did not equal their solo products bit for bit.
using V = float __attribute__((vector_size(4 * L)));
inline V zero() { return V{}; }
// The product and the sum each kept as computed: fast math lets the compiler fuse the two
// into one rounding, or reassociate an accumulator's chain of sums, where it chooses, and
// it chose differently for a tile of one row of x than for two (GCC 12 with AVX2), so a
// batch's rows left their solo products.
inline V fma(V a, V b, V c) {
    V p = a * b;
    asm volatile("" : "+m"(p));
    V s = c + p;
    asm volatile("" : "+m"(s));
    return s;
}
// Lane by lane in order, each sum kept as it is: fast math lets the compiler reassociate a
// sum of lanes, and, as with `fma`, it did so differently for one row of x than for two.
inline float lanes_sum(V v) {
    float s = v[0];
    for (int i = 1; i < L; ++i) {
        s += v[i];
        asm volatile("" : "+m"(s));
    }
    return s;
}
inline V floats(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void in_register(V&) {}
#endif

// The last chunk of a row, n < L values widened into zeroed lanes: no byte past the row read.
template <class T, class Widen>
inline V part(const T* p, int n, Widen widen) {
    alignas(32) float f[L] = {};
    for (int i = 0; i < n; ++i) f[i] = widen(p[i]);
    return floats(f);
}
inline V floats(const float* p, int n) {
    return part(p, n, [](float v) { return v; });
}

struct Int8 {
    using T = int8_t;
#if defined(PRODUCTS_256)
    static V load(const T* p) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
#else
    static V load(const T* p) { return load(p, L); }
#endif
    static V load(const T* p, int n) {
        return part(p, n, [](T v) { return static_cast<float>(v); });
    }
};

struct Half {
    using T = uint16_t;
#if defined(PRODUCTS_256)
    static V load(const T* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
#else
    static V load(const T* p) { return load(p, L); }
#endif
    static V load(const T* p, int n) { return part(p, n, from_half); }
};

struct Float {
    using T = float;
    static V load(const T* p) { return floats(p); }
    static V load(const T* p, int n) { return floats(p, n); }
};
#endif

// A tile of TW weight rows by RX rows of x, one accumulator an output, in registers: each
// chunk of weights loaded serves RX rows and each chunk of x TW weight rows. AVX2's 16
// registers hold 4 x 2 accumulators beside their operands, AVX-512's 32 hold 4 x 4. (Up to
// RX rows of x take one weight row a tile: `product`.)
constexpr int TW = 4;  // product() below dispatches 1 to 4
#if defined(PRODUCTS_512)
constexpr int RX = 4;
#else
constexpr int RX = 2;
#endif
constexpr int64_t AHEAD = 4096;  // bytes: one page ahead of the weights being multiplied

inline float from_bf16(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;  // bfloat16: float32's top half
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// What each output is scaled by and shifted by: int8's row scale (1 for float) and the bias.
struct Affine {
    const uint16_t* scales;  // (N,) bfloat16, or null
    const float* bias;       // (N,), or null
    float scale(int64_t n) const { return scales ? from_bf16(scales[n]) : 1.0f; }
    float shift(int64_t n) const { return bias ? bias[n] : 0.0f; }
};

// y[r, n + t] = (x[r] . w[n + t]) * scale + shift for t < T, r < R: w (N, K), x (R, K),
// y (R, N) row-major. The lanes of an output's accumulator sum its chunks of L in order.
// `next`: float32's rows ask for the same lines of the next T rows as they are read. `later`:
// a tile after its rows' first, which finds them in cache (`weight_rows`).
template <class W, int T, int R, bool later = false>
inline void tile(const typename W::T* w, const float* x, int64_t n, int64_t N, int64_t K,
                 Affine f, float* y, bool next) {
    using E = typename W::T;
    const E* row = w + n * K;
    V acc[R][T];
    for (auto& a : acc)
        for (V& v : a) v = zero();
    auto chunk = [&](int64_t k, int m) {  // m = L, or the last chunk's m < L values
        V wt[T];
        for (int t = 0; t < T; ++t) {
            wt[t] = m == L ? W::load(row + t * K + k) : W::load(row + t * K + k, m);
            // float32's chunks held too where they come from cache: the compiler folds their
            // loads into the multiply-adds (a load a row of x); in the first tile, which
            // waits on memory for them, holding them was slower.
            if constexpr (later && R > 1 && std::is_same_v<E, float>) in_register(wt[t]);
        }
        V xr[R];
        for (int r = 0; r < R; ++r) {
            xr[r] = m == L ? floats(x + r * K + k) : floats(x + r * K + k, m);
            if constexpr (T > 1) in_register(xr[r]);
        }
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < T; ++t) acc[r][t] = fma(wt[t], xr[r], acc[r][t]);
    };
    // The rows lie end to end, so a thread's range is one stream; the hardware's prefetcher
    // stops at each 4 KiB page and starts again only after the first misses on the next, so
    // each cache line of a row asks for the line a page ahead (past the matrix: a no-op).
    // Not float32's rows: they came from memory faster without the hints (docs/bench.md,
    // "One weight row a tile"), float16's and int8's slower. Where several tiles share the
    // rows (`weight_rows`), float32's second tile asks for the next T rows instead.
    constexpr bool hinted = !std::is_same_v<E, float>;
    constexpr int LINE = 64 / sizeof(E) >= L ? 64 / sizeof(E) : L;  // values a step
    int64_t k = 0;
    for (; k + LINE <= K; k += LINE) {
        if constexpr (hinted)
            for (int t = 0; t < T; ++t)
                __builtin_prefetch(reinterpret_cast<const char*>(row + t * K + k) + AHEAD);
        else if (next)
            for (int t = 0; t < T; ++t) __builtin_prefetch(row + (T + t) * K + k);
        for (int c = 0; c < LINE; c += L) chunk(k + c, L);
    }
    for (; k < K; k += L) chunk(k, K - k < L ? static_cast<int>(K - k) : L);
    for (int t = 0; t < T; ++t) {
        const float scale = f.scale(n + t), shift = f.shift(n + t);
        for (int r = 0; r < R; ++r) y[r * N + n + t] = lanes_sum(acc[r][t]) * scale + shift;
    }
}

// The R rows of x (any number) by T weight rows from n: RX rows of x at a time, the first
// tile reading the weights from memory, the later ones finding them in L1.
template <class W, int T>
void weight_rows(const typename W::T* w, const float* x, int64_t n, int64_t R, int64_t N,
                 int64_t K, Affine f, float* y) {
    // The first tile waits on memory for the rows; the second asks for the next T rows, so
    // the next call's first tile finds them in cache (float32's: `tile`'s hints).
    int64_t r = 0;
    for (; r + RX <= R; r += RX) {
        if (r == 0) tile<W, T, RX>(w, x, n, N, K, f, y, false);
        else tile<W, T, RX, true>(w, x + r * K, n, N, K, f, y + r * N, r == RX);
    }
    const float* xr = x + r * K;
    float* yr = y + r * N;
    const bool next = r == RX;
    switch (R - r) {  // fewer than RX left
        case 3: if constexpr (RX > 3) tile<W, T, 3>(w, xr, n, N, K, f, yr, next); break;
        case 2: if constexpr (RX > 2) tile<W, T, 2>(w, xr, n, N, K, f, yr, next); break;
        case 1: tile<W, T, 1>(w, xr, n, N, K, f, yr, next); break;
        default: break;
    }
}

// The most rows of x a tile of one weight row takes: RX, and float32's up to 4 (3 and 4 rows
// came faster so than in tiles of four weight rows with AVX2; float16's did not).
template <class W>
constexpr int ONE_ROW_X = std::is_same_v<typename W::T, float> && RX < 4 ? 4 : RX;

// The R rows of x (at most ONE_ROW_X) by weight row n, in one tile.
template <class W>
inline void one_weight_row(const typename W::T* w, const float* x, int64_t n, int64_t R,
                           int64_t N, int64_t K, Affine f, float* y) {
    constexpr int most = ONE_ROW_X<W>;
    switch (R) {
        case 4: if constexpr (most >= 4) tile<W, 1, 4>(w, x, n, N, K, f, y, false); break;
        case 3: if constexpr (most >= 3) tile<W, 1, 3>(w, x, n, N, K, f, y, false); break;
        case 2: tile<W, 1, 2>(w, x, n, N, K, f, y, false); break;
        default: tile<W, 1, 1>(w, x, n, N, K, f, y, false); break;
    }
}

// y (R, N) = x (R, K) @ w (N, K)^T, each output times scales[n] where given, plus bias[n].
// Threads take equal runs of tiles (OpenMP's pool: started once, kept between calls).
template <class W>
void product(const float* x, const typename W::T* w, const uint16_t* scales, const float* bias,
             float* y, int64_t R, int64_t N, int64_t K, int threads) {
    const Affine f{scales, bias};
    if (R <= ONE_ROW_X<W>) {
        // A decode's one or two rows of x (float32's up to four) fit one tile beside one
        // weight row, and x stays in L1 for the next: each thread then reads the weights as one
        // stream in order, which came from memory faster than four weight rows' streams side
        // by side (docs/bench.md, "One weight row a tile").
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < N; ++n) one_weight_row<W>(w, x, n, R, N, K, f, y);
        return;
    }
    const int64_t tiles = (N + TW - 1) / TW;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < tiles; ++i) {
        const int64_t n = i * TW;
        switch (N - n < TW ? N - n : TW) {
            case 4: weight_rows<W, 4>(w, x, n, R, N, K, f, y); break;
            case 3: weight_rows<W, 3>(w, x, n, R, N, K, f, y); break;
            case 2: weight_rows<W, 2>(w, x, n, R, N, K, f, y); break;
            default: weight_rows<W, 1>(w, x, n, R, N, K, f, y); break;
        }
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
