// e^x for x in [-87.3, 88], within a unit in float32's last place, in arithmetic a loop
// vectorises: with -fno-finite-math-only gcc defines no __FAST_MATH__, so glibc declares no
// vector expf and std::exp was a scalar call for every number. Cephes' expf: e^x = 2^n * e^r,
// |r| <= ln 2 / 2, e^r by its polynomial. Callers clamp x to the range first (the attention
// kernels' scores, the fused activations), each as its inputs need.
// Included inside the includer's anonymous namespace, after <cmath>, <cstdint>, <cstring>.

inline float exp_in_range(float x) {
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);  // x / ln 2, rounded
    // ln 2 in two parts, as fused multiply-adds: fast math would fold a plain x - n * a + n * b
    // into x - n * (a - b) and lose the split's low bits (60 units in the last place at -68)
    const float r = std::fma(n, 2.12194440e-4f, std::fma(n, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, -126 <= n <= 127
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
