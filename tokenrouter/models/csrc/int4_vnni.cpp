// int4 weights times fp32 activations with AVX512-VNNI integer dot products: the `int4-vnni` and `int4-vnni-a8`
// kernels, built by `tokenrouter.models.native` at first use.
//
// int4-vnni splits each row of x per block of 32 columns into two int8 digits: x ~ xs * (254 * hi + lo) with
// hi = round(x / (254 xs)) and lo the rounded remainder, so the activation keeps about 15 bits (bf16 keeps 8).
// int4-vnni-a8 keeps the high digit alone, x ~ xs * hi with xs = amax / 127 (llama.cpp's Q8_0 activations): half
// the dot products, for an activation of about 8 bits per block of 32.
// A block's dot products with the 4-bit codes are integer (vpdpbusd: unsigned codes times signed digits), then
// scaled by the weight's scale and xs; the weight's zero enters through the exact fp32 sum of the block:
//   y[n] = sum_b  scale[n,b] * xs[b] * sum_j code[n,b,j] * (254 hi[b,j] + lo[b,j])  +  low[n,b] * sum_j x[b,j]
// (int4-vnni-a8: hi[b,j] alone in the integer sum). Weights are read once per call whatever the batch, near
// memory bandwidth at one row, where torch's int4 kernel (which converts every code to floating point) is
// compute-bound on a few cores; with several rows the dot products bound the call, and int4-vnni-a8 takes about
// 0.6 of int4-vnni's time there. A row's result does not depend on the other rows of the batch.
//
// Weights come in groups of four output rows, so one 512-bit register holds one block of four rows:
//   codes: [N/4, K/32, 4, 16] uint8: row r's 16 bytes of a block hold column j (low nibble) and j+16 (high)
//   scale, low: [N/4, K/32, 4] float16: w = code * scale + low
#include <torch/extension.h>
#include "parallel.h"
#include <immintrin.h>

namespace {

constexpr float DIGIT = 254.f;  // the high digit's weight: the remainder of hi spans [-127, 127] in lo
// NOTE: how far ahead of the weights being read they are prefetched, in bytes (32 blocks). The weights stream
// from memory once per call, and the hardware prefetchers alone kept a core well below its share of the
// bandwidth: the 151936x1536 lm_head at one row took 7.9 ms on two threads without, 4.4 with (17920x1536: 0.59
// -> 0.37; 4096 ahead measured the same; Intel Xeon, 480 MiB L3, 2026-12-05). A prefetch past the end of the
// weights is harmless: it never faults.
constexpr int64_t PREFETCH = 2048;
// rows of x per pass over a group's weights (each pass unpacks the nibbles once for all its rows): a batch of
// 1-16 rows takes 1-3 passes, split evenly (5 rows: one pass; 16: 5, 5, 6). Passes of up to 6 against the
// earlier pairs of rows, weights streamed over 28 layers on two threads: 17920x1536 at 4 / 5 / 16 rows 1.46 /
// 1.64 / 4.48 -> 1.08 / 1.29 / 3.98 ms, 1536x8960 at 5 rows 0.89 -> 0.63 (Intel Xeon, 2026-12-05; 3 and 4 fell
// between; one and two rows unchanged)
constexpr int MAX_ROWS = 6;

// DIGITS 2: hi and lo as above; 1: hi alone (lo is not written)
template <int DIGITS>
void split_rows(const float* x, int64_t M, int64_t K, int8_t* hi, int8_t* lo, float* xs, float* xsum) {
  const __m512 digit = _mm512_set1_ps(DIGIT);
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    const float* v = x + i * 32;
    __m512 a[2] = {_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16)};
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a[0]), _mm512_abs_ps(a[1])));
    __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
    for (int h = 0; h < 2; ++h) {
      __m512 t = _mm512_mul_ps(a[h], inv);
      __m512i q = _mm512_cvtps_epi32(t);  // to nearest even (the default rounding mode)
      _mm_storeu_si128((__m128i*)(hi + i * 32 + 16 * h), _mm512_cvtsepi32_epi8(q));
      if constexpr (DIGITS == 2) {
        __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(q)), digit));
        _mm_storeu_si128((__m128i*)(lo + i * 32 + 16 * h), _mm512_cvtsepi32_epi8(r));
      }
    }
    xs[i] = DIGITS == 2 ? amax / (127.f * DIGIT) : amax / 127.f;
    xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
  }
}

// 16 int8 values in each 128-bit lane: one block's half for each of the four weight rows
inline __m512i broadcast16(const int8_t* v) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)v)); }

// Rows m0..m0+MB of x against the group of four weight rows starting at output row n0.
template <int MB, int DIGITS>
void group_rows(const uint8_t* w, const uint16_t* sg, const uint16_t* lg, int64_t K, int64_t N, int64_t n0,
                const int8_t* hi, const int8_t* lo, const float* xs, const float* xsum, float* out) {
  const int64_t B = K / 32;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // row r: lanes 4r..4r+3
  const __m512 digit = _mm512_set1_ps(DIGIT);
  __m512 acc[MB];
  __m128 acc_low[MB];
  for (int i = 0; i < MB; ++i) {
    acc[i] = _mm512_setzero_ps();
    acc_low[i] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < B; ++b) {
    _mm_prefetch((const char*)(w + b * 64 + PREFETCH), _MM_HINT_T0);  // a block is one line of codes
    if ((b & 7) == 0) _mm_prefetch((const char*)(sg + b * 4 + PREFETCH / 8), _MM_HINT_T0);  // 8 bytes a block
    if ((b & 7) == 4) _mm_prefetch((const char*)(lg + b * 4 + PREFETCH / 8), _MM_HINT_T0);
    __m512i p = _mm512_loadu_si512((const void*)(w + b * 64));
    __m512i first = _mm512_and_si512(p, nib), second = _mm512_and_si512(_mm512_srli_epi16(p, 4), nib);
    __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(
        _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(sg + b * 4)))));
    __m128 low = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(lg + b * 4)));
    for (int i = 0; i < MB; ++i) {
      const int8_t* h = hi + i * K + b * 32;
      __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, broadcast16(h));
      dh = _mm512_dpbusd_epi32(dh, second, broadcast16(h + 16));
      __m512 dot;
      if constexpr (DIGITS == 2) {
        const int8_t* l = lo + i * K + b * 32;
        __m512i dl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, broadcast16(l));
        dl = _mm512_dpbusd_epi32(dl, second, broadcast16(l + 16));
        // integers below 2^24: exact in fp32
        dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dh), digit, _mm512_cvtepi32_ps(dl));
      } else {
        dot = _mm512_cvtepi32_ps(dh);
      }
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(xs[i * B + b])), acc[i]);
      acc_low[i] = _mm_fmadd_ps(low, _mm_set1_ps(xsum[i * B + b]), acc_low[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    alignas(64) float lanes[16];
    alignas(16) float lows[4];
    _mm512_store_ps(lanes, acc[i]);
    _mm_store_ps(lows, acc_low[i]);
    for (int r = 0; r < 4 && n0 + r < N; ++r)
      out[i * N + n0 + r] = (lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3]) + lows[r];
  }
}

template <int DIGITS>
torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                      const torch::Tensor& low, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: a 2-d float32 tensor");
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == 4 && codes.size(3) == 16 && codes.is_contiguous() &&
              codes.scalar_type() == torch::kUInt8, "codes: a contiguous [N/4, K/32, 4, 16] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), B = K / 32, G = codes.size(0);
  TORCH_CHECK(K % 32 == 0 && codes.size(1) == B, "x: ", K, " columns; the codes hold ", codes.size(1), " blocks of 32");
  TORCH_CHECK(N <= 4 * G && N > 4 * (G - 1), "N: ", N, " rows do not fill ", G, " groups of four");
  TORCH_CHECK(scale.is_contiguous() && low.is_contiguous() && scale.scalar_type() == torch::kFloat16 &&
              low.scalar_type() == torch::kFloat16 && scale.numel() == G * B * 4 && low.numel() == G * B * 4,
              "scale, low: contiguous [N/4, K/32, 4] float16 tensors");
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  auto xc = x.contiguous();
  auto hi = torch::empty({M, K}, torch::kInt8), lo = torch::empty({DIGITS == 2 ? M : 0, K}, torch::kInt8);
  auto xs = torch::empty({M, B}, torch::kFloat32), xsum = torch::empty({M, B}, torch::kFloat32);
  int8_t* R = DIGITS == 2 ? lo.data_ptr<int8_t>() : nullptr;
  split_rows<DIGITS>(xc.data_ptr<float>(), M, K, hi.data_ptr<int8_t>(), R, xs.data_ptr<float>(),
                     xsum.data_ptr<float>());
  const uint8_t* W = codes.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* L = reinterpret_cast<const uint16_t*>(low.data_ptr<at::Half>());
  const int8_t* H = hi.data_ptr<int8_t>();
  const float* XS = xs.data_ptr<float>();
  const float* XSUM = xsum.data_ptr<float>();
  float* O = out.data_ptr<float>();
  tokenrouter::over_groups<MAX_ROWS>(G, M, [&](int64_t g, int64_t m, auto rows) {
    group_rows<decltype(rows)::value, DIGITS>(W + g * B * 64, S + g * B * 4, L + g * B * 4, K, N, g * 4, H + m * K,
                                              R ? R + m * K : nullptr, XS + m * B, XSUM + m * B, O + m * N);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm<2>, "x [M, K] float32 (two int8 digits) times int4 weights in groups of four rows");
  m.def("int4_mm_a8", &int4_mm<1>, "x [M, K] float32 (one int8 digit) times int4 weights in groups of four rows");
}
