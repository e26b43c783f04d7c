// int4 and int8 weights times fp32 activations with AVX512-VNNI integer dot products: the `int4-vnni`,
// `int4-vnni-a8` and `int8-vnni` kernels, built by `tokenrouter.models.native` at first use.
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
// Weights come in groups of sixteen output rows, one per 32-bit lane of a 512-bit register, so a vpdpbusd takes
// four columns of all sixteen rows against four digits of a row of x broadcast to every lane: a block of 32
// columns is eight such quads (columns 4q..4q+3), and its integer dot product ends in the row's own lane, exact,
// before anything is scaled. The nibbles of a block are unpacked once per pass for all its rows of x.
//   codes: [N/16, K/32, 4, 16, 4] uint8: register j's lane r (output row r), byte t holds column 4j+t in the low
//          nibble and 16+4j+t in the high one (quads j and j+4)
//   scale, low: [N/16, K/32, 16] float16: w = code * scale + low
// A row's result is, per lane and block b, in this order (int4-avx2 does the same operations, the same floats):
//   dot = float(sum hi*code)   (two digits: fma(float(sum hi*code), 254, float(sum lo*code)), exact: below 2^24)
//   acc = fma(dot, scale * xs[b], acc);  acc = fma(low, xsum[b], acc)
//
// int8-vnni: signed codes, one fp32 scale per output row, both digits as one int16 v = 254 hi + lo (|v| <= 32385),
// in the same groups of sixteen rows: vpdpwssd multiplies two columns of the sixteen rows (widened to 16 bits as
// they are loaded) by the row of x's two values of v broadcast, and sums the pair into the row's lane. A block's
// sixteen pairs end in an exact int32 (at most 32 * 128 * 32385 < 2^31), scaled once:
//   acc = fma(float(sum_j w[n,b,j] * v[b,j]), xs[b], acc);  y[n] = scale[n] * acc
//   codes: [N/16, Kp/32, 16, 16, 2] int8: register c's lane r holds columns 2c, 2c+1 of output row r; Kp is K
//          rounded up to 32 (the weights zero beyond K, the activations too)
//   scale: [N/16 * 16] float32
// One vpdpwssd takes 32 products, as a vpdpbusd on one digit of two would: the split costs nothing in the dot
// products, and nothing has to correct for unsigned operands. int8-avx2 (csrc/avx2_gemm.cpp) computes the same
// floats.
#include <torch/extension.h>
#include "parallel.h"
#include <immintrin.h>

#include <cstring>

namespace {

constexpr float DIGIT = 254.f;  // the high digit's weight: the remainder of hi spans [-127, 127] in lo
// NOTE: how far ahead of the weights being read they are prefetched, in bytes (8 blocks of sixteen rows). The
// weights stream from memory once per call, and the hardware prefetchers alone kept a core well below its share
// of the bandwidth: the 151936x1536 lm_head at one row took 7.9 ms on two threads without, 4.4 with (17920x1536:
// 0.59 -> 0.37; 4096 ahead measured the same; Intel Xeon, 480 MiB L3, 2026-12-05, groups of four rows; on
// sixteen, 4096 and 8192 were no faster). A prefetch past the end of the weights is harmless: it never faults.
constexpr int64_t PREFETCH = 2048;
// rows of x per pass over a group's weights (each pass unpacks the nibbles once for all its rows): a batch of
// 1-16 rows takes 1-3 passes, split evenly (5 rows: one pass; 16: 5, 5, 6). Passes of up to 6 against the
// earlier pairs of rows, weights streamed over 28 layers on two threads: 17920x1536 at 4 / 5 / 16 rows 1.46 /
// 1.64 / 4.48 -> 1.08 / 1.29 / 3.98 ms, 1536x8960 at 5 rows 0.89 -> 0.63 (Intel Xeon, 2026-12-05; 3 and 4 fell
// between; one and two rows unchanged)
constexpr int MAX_ROWS = 6;
// the same for int8 (each row holds an int32 and an fp32 sum, so six rows fit the registers with room): with the
// codes widened a pair of columns at a time, 9728x896 at 16 rows took 0.91 ms against int8-avx2's 1.53 (groups of
// four rows: 1.46-1.54); passes of 4 or 3 measured slower with the earlier loop (AMD EPYC Zen 4, 2026-12-07)
constexpr int MAX_ROWS_INT8 = 6;

// A block of 32 floats' digits: hi (and, LO, lo) per half of 16 columns, as int32 lanes, and its amax.
struct BlockDigits {
  __m512i hi[2], lo[2];
  float amax;
};

template <bool LO>
inline BlockDigits block_digits(const __m512 a[2]) {
  BlockDigits d;
  d.amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a[0]), _mm512_abs_ps(a[1])));
  const __m512 inv = _mm512_set1_ps(d.amax > 0 ? 127.f / d.amax : 0.f);
  for (int h = 0; h < 2; ++h) {
    __m512 t = _mm512_mul_ps(a[h], inv);
    d.hi[h] = _mm512_cvtps_epi32(t);  // to nearest even (the default rounding mode)
    if constexpr (LO)  // the remainder times 254
      d.lo[h] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(d.hi[h])), _mm512_set1_ps(DIGIT)));
  }
  return d;
}

// int4: DIGITS 2: hi and lo as above; 1: hi alone (lo is not written)
template <int DIGITS>
void split_rows(const float* x, int64_t M, int64_t K, int8_t* hi, int8_t* lo, float* xs, float* xsum) {
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    const float* v = x + i * 32;
    const __m512 a[2] = {_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16)};
    const BlockDigits d = block_digits<DIGITS == 2>(a);
    for (int h = 0; h < 2; ++h) {
      _mm_storeu_si128((__m128i*)(hi + i * 32 + 16 * h), _mm512_cvtsepi32_epi8(d.hi[h]));
      if constexpr (DIGITS == 2) _mm_storeu_si128((__m128i*)(lo + i * 32 + 16 * h), _mm512_cvtsepi32_epi8(d.lo[h]));
    }
    xs[i] = DIGITS == 2 ? d.amax / (127.f * DIGIT) : d.amax / 127.f;
    xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
  }
}

// int8: x [M, K] -> v [M, Kp/32, 32] int16 in column order, v = 254 hi + lo, and xs [M, Kp/32]; a last partial
// block is read as if zero-padded.
void split_words(const float* x, int64_t M, int64_t K, int64_t Kp, int16_t* v, float* xs) {
  const int64_t B = Kp / 32;
  const __mmask16 all = 0xFFFF;
  for (int64_t i = 0; i < M * B; ++i) {
    const int64_t m = i / B, col = (i % B) * 32, left = K - col;
    const float* p = x + m * K + col;
    const __mmask16 first = left >= 16 ? all : (__mmask16)((1u << left) - 1);
    const __mmask16 second = left >= 32 ? all : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
    const __m512 a[2] = {_mm512_maskz_loadu_ps(first, p), _mm512_maskz_loadu_ps(second, p + 16)};
    const BlockDigits d = block_digits<true>(a);
    for (int h = 0; h < 2; ++h) {
      __m512i c = _mm512_add_epi32(_mm512_mullo_epi32(d.hi[h], _mm512_set1_epi32(254)), d.lo[h]);
      _mm256_storeu_si256((__m256i*)(v + i * 32 + 16 * h), _mm512_cvtepi32_epi16(c));
    }
    xs[i] = d.amax / (127.f * DIGIT);
  }
}

// Four digits of a row of x, for a vpdpbusd to broadcast.
// NOTE: read one at a time from memory so that the compiler broadcasts them with a load (vpbroadcastd zmm, m32).
// Copied eight at once into a local array, they went through general registers (mov, sar, vpbroadcastd zmm, r32):
// 17920x1536 at 5 / 16 rows 0.605 / 2.00 -> 0.444 / 1.52 ms with one digit, 1.13 / 3.61 -> 0.82 / 2.64 with two
// (weights in cache, the same floats; AMD EPYC Zen 4, 2026-12-07).
inline __m512i quad(const int8_t* d, int j) {
  int32_t v;
  std::memcpy(&v, d + 4 * j, 4);
  return _mm512_set1_epi32(v);
}

// One row's integer dot products of a block with the sixteen rows' codes q (its eight quads): d its digits.
// Two chains of four vpdpbusd, so one row is not bound by a single chain's latency.
inline __m512i block_dot(const __m512i q[8], const int8_t* d) {
  __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], quad(d, 0));
  __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], quad(d, 1));
  for (int j = 2; j < 8; j += 2) {
    a = _mm512_dpbusd_epi32(a, q[j], quad(d, j));
    b = _mm512_dpbusd_epi32(b, q[j + 1], quad(d, j + 1));
  }
  return _mm512_add_epi32(a, b);
}

// Rows 0..MB of x (hi, lo, xs, xsum at the pass's first row) against the group of sixteen weight rows starting at
// output row n0.
template <int MB, int DIGITS>
void group_rows(const uint8_t* w, const uint16_t* sg, const uint16_t* lg, int64_t K, int64_t N, int64_t n0,
                const int8_t* hi, const int8_t* lo, const float* xs, const float* xsum, float* out) {
  const int64_t B = K / 32;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512 digit = _mm512_set1_ps(DIGIT);
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = w + b * 256;  // four lines of codes a block
    for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(wb + 64 * j + PREFETCH), _MM_HINT_T0);
    if ((b & 1) == 0) {  // 32 bytes a block each
      _mm_prefetch((const char*)(sg + b * 16 + PREFETCH / 8), _MM_HINT_T0);
      _mm_prefetch((const char*)(lg + b * 16 + PREFETCH / 8), _MM_HINT_T0);
    }
    __m512i q[8];
    for (int j = 0; j < 4; ++j) {
      __m512i p = _mm512_loadu_si512((const void*)(wb + 64 * j));
      q[j] = _mm512_and_si512(p, nib);
      q[j + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nib);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sg + b * 16)));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(lg + b * 16)));
    for (int i = 0; i < MB; ++i) {
      __m512 dot = _mm512_cvtepi32_ps(block_dot(q, hi + i * K + b * 32));
      if constexpr (DIGITS == 2)
        dot = _mm512_fmadd_ps(dot, digit, _mm512_cvtepi32_ps(block_dot(q, lo + i * K + b * 32)));
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(xs[i * B + b])), acc[i]);
      acc[i] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsum[i * B + b]), acc[i]);
    }
  }
  const __mmask16 rows = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
  for (int i = 0; i < MB; ++i) _mm512_mask_storeu_ps(out + i * N + n0, rows, acc[i]);
}

template <int DIGITS>
torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                      const torch::Tensor& low, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: a 2-d float32 tensor");
  TORCH_CHECK(codes.dim() == 5 && codes.size(2) == 4 && codes.size(3) == 16 && codes.size(4) == 4 &&
              codes.is_contiguous() && codes.scalar_type() == torch::kUInt8,
              "codes: a contiguous [N/16, K/32, 4, 16, 4] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), B = K / 32, G = codes.size(0);
  TORCH_CHECK(K % 32 == 0 && codes.size(1) == B, "x: ", K, " columns; the codes hold ", codes.size(1), " blocks of 32");
  TORCH_CHECK(N <= 16 * G && N > 16 * (G - 1), "N: ", N, " rows do not fill ", G, " groups of sixteen");
  TORCH_CHECK(scale.is_contiguous() && low.is_contiguous() && scale.scalar_type() == torch::kFloat16 &&
              low.scalar_type() == torch::kFloat16 && scale.numel() == G * B * 16 && low.numel() == G * B * 16,
              "scale, low: contiguous [N/16, K/32, 16] float16 tensors");
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
    group_rows<decltype(rows)::value, DIGITS>(W + g * B * 256, S + g * B * 16, L + g * B * 16, K, N, g * 16, H + m * K,
                                              R ? R + m * K : nullptr, XS + m * B, XSUM + m * B, O + m * N);
  });
  return out;
}

// Rows 0..MB of x (v and xs at the pass's first row) against the int8 group of sixteen weight rows starting at
// output row n0. Per block, each pair of columns is widened to int16 once and feeds one vpdpwssd per row of x (the
// row's two values of v broadcast), each row summing the block in one int32 chain.
// NOTE: widening the block's sixteen pairs first and then summing each row in two chains (as int4's block_dot)
// measured 1.5x slower from 5 rows on (9728x896 at 16 rows 1.46 against 0.93 ms, at 512 rows 33.9 against 23.6;
// the same integers): sixteen registers of codes, two chains and six rows' sums do not fit the thirty-two. A pass
// over two groups at once, each broadcast feeding both, measured the same as one (AMD EPYC Zen 4, 2026-12-07).
template <int MB>
void int8_rows(const int8_t* w, const float* scale, int64_t B, int64_t N, int64_t n0, const int16_t* v,
               const float* xs, float* out) {
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const int8_t* wb = w + b * 512;
    for (int j = 0; j < 8; ++j) _mm_prefetch((const char*)(wb + 64 * j + PREFETCH), _MM_HINT_T0);  // 512 bytes
    __m512i dot[MB];
    for (int i = 0; i < MB; ++i) dot[i] = _mm512_setzero_si512();
    for (int c = 0; c < 16; ++c) {  // columns 2c, 2c + 1
      const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wb + 32 * c)));
      for (int i = 0; i < MB; ++i) {
        int32_t pair;
        std::memcpy(&pair, v + (i * B + b) * 32 + 2 * c, 4);
        dot[i] = _mm512_dpwssd_epi32(dot[i], q, _mm512_set1_epi32(pair));
      }
    }
    for (int i = 0; i < MB; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_set1_ps(xs[i * B + b]), acc[i]);
  }
  const __mmask16 rows = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
  const __m512 s = _mm512_loadu_ps(scale + n0);
  for (int i = 0; i < MB; ++i) _mm512_mask_storeu_ps(out + i * N + n0, rows, _mm512_mul_ps(acc[i], s));
}

torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: a 2-d float32 tensor");
  TORCH_CHECK(codes.dim() == 5 && codes.size(2) == 16 && codes.size(3) == 16 && codes.size(4) == 2 &&
              codes.is_contiguous() && codes.scalar_type() == torch::kInt8,
              "codes: a contiguous [N/16, Kp/32, 16, 16, 2] int8 tensor");
  const int64_t M = x.size(0), K = x.size(1), B = codes.size(1), G = codes.size(0);
  TORCH_CHECK(B == (K + 31) / 32, "x: ", K, " columns; the codes hold ", B, " blocks of 32");
  TORCH_CHECK(N <= 16 * G && N > 16 * (G - 1), "N: ", N, " rows do not fill ", G, " groups of sixteen");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32 && scale.numel() == 16 * G,
              "scale: a contiguous [N/16 * 16] float32 tensor");
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  auto xc = x.contiguous();
  auto v = torch::empty({M, B, 32}, torch::kInt16);
  auto xs = torch::empty({M, B}, torch::kFloat32);
  split_words(xc.data_ptr<float>(), M, K, B * 32, v.data_ptr<int16_t>(), xs.data_ptr<float>());
  const int8_t* W = codes.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  const int16_t* V = v.data_ptr<int16_t>();
  const float* XS = xs.data_ptr<float>();
  float* O = out.data_ptr<float>();
  tokenrouter::over_groups<MAX_ROWS_INT8>(G, M, [&](int64_t g, int64_t m, auto rows) {
    int8_rows<decltype(rows)::value>(W + g * B * 512, S, B, N, g * 16, V + m * B * 32, XS + m * B, O + m * N);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm<2>, "x [M, K] float32 (two int8 digits) times int4 weights in groups of sixteen rows");
  m.def("int8_mm", &int8_mm, "x [M, K] float32 times int8 weights in groups of sixteen rows");
  m.def("int4_mm_a8", &int4_mm<1>, "x [M, K] float32 (one int8 digit) times int4 weights in groups of sixteen rows");
}
