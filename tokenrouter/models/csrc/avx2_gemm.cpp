// int4 and int8 weights times fp32 activations with AVX2 integer dot products (vpmaddwd): the `int4-avx2`,
// `int4-avx2-a8` and `int8-avx2` kernels, built by `tokenrouter.models.native` at first use with AVX2-level
// flags only (-mavx2 -mfma -mf16c), so the object runs on any CPU with those.
//
// Activations as int4-vnni takes them (csrc/vnni_gemm.cpp): each row split per block of 32 columns into int8
// digits, x ~ xs * (254 * hi + lo), about 15 bits, or hi alone (x ~ xs * hi, xs = amax / 127, the -a8 kernels).
//
// int4-avx2 and int4-avx2-a8: int4-vnni's and int4-vnni-a8's layout and arithmetic, bit for bit. A group of
// sixteen weight rows is taken as two halves of eight, one row per 32-bit lane of a 256-bit register; vpmaddubsw
// multiplies the unsigned codes of four columns by a digit's four bytes broadcast to every lane and sums pairs
// (at most 2 * 15 * 127, nothing saturates), the eight quads of a block are added in int16 (at most 30480), and
// one vpmaddwd by ones leaves each row's integer dot product of the block in its lane: int4-vnni's integer,
// then the same fp32 operations in the same order:
//   dot = float(sum hi*code)   (two digits: fma(float(sum hi*code), 254, float(sum lo*code)))
//   acc = fma(dot, scale * xs[b], acc);  acc = fma(low, xsum[b], acc)
//   codes: [N/16, K/32, 4, 16, 4] uint8; scale, low: [N/16, K/32, 16] float16 (as int4-vnni's)
// int8-avx2: int8-vnni's layout and arithmetic (csrc/vnni_gemm.cpp), bit for bit: signed codes, one fp32 scale
// per output row, the two digits as one int16 v = 254 hi + lo. A group of sixteen weight rows is taken as two
// halves of eight, one row per 32-bit lane; vpmaddwd multiplies two columns of the eight rows (widened to 16 bits)
// by the row of x's two values of v broadcast and sums the pair, and the block's sixteen pairs are added in int32:
// int8-vnni's exact integer, then the same fp32 operations:
//   acc = fma(float(sum_j w[n,b,j] * v[b,j]), xs[b], acc);  y[n] = scale[n] * acc
//   codes: [N/16, Kp/32, 16, 16, 2] int8; scale: [N/16 * 16] float32 (as int8-vnni's)
// Built with -mavxvnni as well (`avxvnni`: the int4-avxvnni, int4-avxvnni-a8 and int8-avxvnni kernels, for CPUs
// with AVX-VNNI and no AVX-512, such as Intel's laptop cores since Alder Lake), the same integers come from
// AVX-VNNI's 256-bit dot products: vpdpbusd sums a lane's four code-digit products into int32 where vpmaddubsw,
// vpaddw and the block's last vpmaddwd took three instructions, and vpdpwssd replaces int8's vpmaddwd and vpaddd.
// Neither saturates nor rounds, so the floats are the same bit for bit.
// Weights are read once per call whatever the batch, in passes of up to a few rows of x, split evenly (each row's
// accumulators in registers); a group stays in L1 or L2 while the passes read it again. A row's result does not
// depend on the other rows of the batch.
#include <torch/extension.h>
#include "parallel.h"
#include <immintrin.h>

#include <cstring>
#include <type_traits>

namespace {

constexpr float DIGIT = 254.f;  // the high digit's weight: the remainder of hi spans [-127, 127] in lo
constexpr int64_t BLOCK = 32;
// rows of x per pass over an int4 group, one digit / two; a pass takes both halves of the group in one loop, each
// broadcast digit serving both. On an AVX2-only AMD EPYC (Zen 3, two threads, 2026-12-07), ms per call on 96 MB of
// distinct copies (streamed from memory), one digit, passes of up to 5 rows of which those of 5 took a loop a half
// (the fewer registers a row) -> these: 17920x1536 at 5 rows 1.36 -> 1.08, 6 1.36 -> 1.33, 10 2.72 -> 1.96, 16 3.62
// -> 3.19; 1536x8960 at 5 rows 0.65 -> 0.51; at 1 row the same (0.59, 0.42). The loop a half measured best for 5
// rows on a Zen 4 running this AVX2 code (2026-12-06), not on a CPU that runs it for want of AVX-512.
constexpr int MAX_ROWS_A8 = 6;
constexpr int MAX_ROWS_INT4 = 3;
// int8: rows of x per pass over a group, and up to how many a pass takes both halves in one loop (a row holds an
// int32 and an fp32 accumulator a half: 3 rows of both halves or 6 of one, with the codes and the broadcast, fill
// the sixteen registers). Against the earlier groups of four rows (a pass per pair of rows, four int32 lanes a row
// summed at the end), ms per call the same within this VM's noise at 1-16 rows (9728x896 at 16 rows 1.41 against
// 1.46-1.54; AMD EPYC Zen 4 under AVX2, 2026-12-06); what changed is int8-vnni's floats, bit for bit.
constexpr int MAX_ROWS_INT8 = 6;
constexpr int BOTH_HALVES_INT8 = 3;
// NOTE: how far ahead of the weights being read they are prefetched, in bytes (8 int4 blocks, 16 int8 ones).
// The weights stream from memory once per call, and the hardware prefetchers alone left a core at 6.7 GB/s:
// an int4 17920x1536 projection at one row took 2.41 ms on one thread without, 1.01 with (1024 ahead: 1.22,
// 4096: 1.27); the 151936x1536 lm_head 20.6 -> 11.8 ms, 11.7 -> 5.2 on two threads (Intel Xeon, 480 MiB L3,
// 2026-12-05). A prefetch past the end of the weights is harmless: it never faults.
constexpr int64_t PREFETCH = 2048;

__attribute__((always_inline)) inline void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }

// `sum` plus the products of four columns' codes (unsigned, one row a lane) with the same four digits in every lane,
// twice: int16 pairs (vpmaddubsw, at most 2 * 15 * 127 each; eight quads of a block at most 30480), or each lane's
// int32 with AVX-VNNI (vpdpbusd)
inline __m256i add_quads(__m256i sum, __m256i codes0, __m256i q0, __m256i codes1, __m256i q1) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(sum, codes0, q0), codes1, q1);
#else
  sum = _mm256_add_epi16(sum, _mm256_add_epi16(_mm256_maddubs_epi16(codes0, q0), _mm256_maddubs_epi16(codes1, q1)));
  // NOTE: the sum held in a register here. GCC 12 reads _mm256_add_epi16 as a plain vector add and reassociates
  // a block's chain of them: it computed all the products of a pass's quads first, and the sixteen registers
  // could not hold them (a pass of five rows moved 103 registers to and from the stack a block, 83 instructions a
  // row and block where 63 remain). On an AMD EPYC Zen 5 running this code: 17920x1536 at five rows 0.81-1.18 ->
  // 0.60-0.83 ms a call over three runs, the same integers (docs/kernels.md, "The products' sums in registers").
  asm("" : "+x"(sum));
  return sum;
#endif
}

// a block's sums of add_quads as each lane's int32
inline __m256i lane_dot(__m256i sum) {
#if defined(__AVXVNNI__)
  return sum;
#else
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
}

// `dot` plus each lane's two int16 products of `w` and `v` (int32, exact: neither is -32768)
inline __m256i add_pairs(__m256i dot, __m256i w, __m256i v) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(dot, w, v);
#else
  return _mm256_add_epi32(dot, _mm256_madd_epi16(w, v));
#endif
}

// sixteen int32 (columns 0-15 of a block's half, each in [-32385, 32385]) -> int16 in column order
inline __m256i column_words(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // the pack interleaves 128-bit lanes
}

// The sum of 32 floats in _mm512_reduce_add_ps's order over int4-vnni's two registers of 16, bit for bit.
inline float block_sum(const __m256 v[4]) {
  __m256 t3 = _mm256_add_ps(_mm256_add_ps(v[1], v[3]), _mm256_add_ps(v[0], v[2]));
  __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

inline float block_amax(const __m256 v[4]) {
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                           _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)));
  __m128 h = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// How a kernel takes the activations' digits per block of 32 columns, in column order: int4's as int8, the high
// digit's 32 (kHi) or the high's then the low's (kHiLo); int8's two as one int16, v = 254 hi + lo (|v| <= 32385).
enum class Form { kHi, kHiLo, kWords };

template <Form F>
using Digit = std::conditional_t<F == Form::kWords, int16_t, int8_t>;

template <Form F>
constexpr int64_t PER_BLOCK = F == Form::kHiLo ? 2 * BLOCK : BLOCK;  // a block's digits

// A block's 32 int8 digits in column order from four registers of eight int32 (each in [-127, 127]).
inline __m256i column_bytes(const __m256i d[4]) {
  // the packs interleave 128-bit lanes: lane 0 holds d[h][0..3] of each h, lane 1 d[h][4..7]
  __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(d[0], d[1]), _mm256_packs_epi32(d[2], d[3]));
  return _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// x [M, K] -> v [M, Kp/32, PER_BLOCK<F>], xs and xsum [M, Kp/32]; a last partial block is read as if zero-padded.
template <Form F>
void split_rows(const float* x, int64_t M, int64_t K, int64_t Kp, Digit<F>* v, float* xs, float* xsum) {
  const int64_t B = Kp / BLOCK;
  tokenrouter::parallel_for(0, M * B, 512, [&](int64_t i0, int64_t i1) {
    const __m256 digit = _mm256_set1_ps(DIGIT);
    alignas(32) float tail[BLOCK];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / B, col = (i % B) * BLOCK;
      const float* p = x + m * K + col;
      if (col + BLOCK > K) {
        std::fill(tail, tail + BLOCK, 0.f);
        std::copy(p, p + (K - col), tail);
        p = tail;
      }
      __m256 a[4] = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)};
      float amax = block_amax(a);
      __m256 inv = _mm256_set1_ps(amax > 0 ? 127.f / amax : 0.f);
      __m256i hi[4], lo[4];
      for (int h = 0; h < 4; ++h) {
        __m256 t = _mm256_mul_ps(a[h], inv);
        hi[h] = _mm256_cvtps_epi32(t);  // to nearest even (the default rounding mode), as int4-vnni
        if constexpr (F != Form::kHi)  // the low digit: the remainder times 254
          lo[h] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, _mm256_cvtepi32_ps(hi[h])), digit));
      }
      Digit<F>* out = v + i * PER_BLOCK<F>;
      if constexpr (F == Form::kWords) {
        for (int h = 0; h < 4; ++h) hi[h] = _mm256_add_epi32(_mm256_mullo_epi32(hi[h], _mm256_set1_epi32(254)), lo[h]);
        for (int half = 0; half < 2; ++half)
          _mm256_storeu_si256((__m256i*)out + half, column_words(hi[2 * half], hi[2 * half + 1]));
      } else {
        _mm256_storeu_si256((__m256i*)out, column_bytes(hi));
        if constexpr (F == Form::kHiLo) _mm256_storeu_si256((__m256i*)(out + BLOCK), column_bytes(lo));
      }
      xs[i] = F == Form::kHi ? amax / 127.f : amax / (127.f * DIGIT);
      xsum[i] = block_sum(a);
    }
  });
}

template <Form F>
struct Digits {  // one split batch of x
  const Digit<F>* v;
  const float* xs;
  const float* xsum;
  int64_t B;
};

// eight lanes (output rows first..first+8) of a row's result, the part beyond N left out
inline void store_rows(__m256 acc, int64_t N, int64_t first, float* o) {
  const int64_t rows = std::min<int64_t>(8, N - first);
  if (rows == 8) {
    _mm256_storeu_ps(o, acc);
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (int64_t r = 0; r < rows; ++r) o[r] = lanes[r];
}

// Rows m0..m0+MB of x against the int4 group of sixteen weight rows starting at output row n0, both halves (eight
// weight rows a half, one a lane) in one loop, each broadcast digit serving both. A pass per half (which kept more
// rows of x within the sixteen registers) measured slower on an AVX2-only CPU, and streamed each group's lines from
// memory in its first half's pass to read them again from L1 or L2 in the second (a half's codes are 32 of each
// 64-byte line).
template <int MB, Form F>
void int4_pass(const uint8_t* w, const uint16_t* sg, const uint16_t* lg, const Digits<F>& d, int64_t m0, int64_t N,
               int64_t n0, float* out) {
  constexpr int DIGITS = F == Form::kHiLo ? 2 : 1;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256 digit = _mm256_set1_ps(DIGIT);
  __m256 acc[2][MB];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < MB; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < d.B; ++b) {
    const uint8_t* wb = w + b * 256;
    for (int j = 0; j < 4; ++j) prefetch(wb + 64 * j + PREFETCH);
    if ((b & 1) == 0) {  // 32 bytes a block each
      prefetch(sg + b * 16 + PREFETCH / 8);
      prefetch(lg + b * 16 + PREFETCH / 8);
    }
    __m256i sum[DIGITS][2][MB];  // the block's products so far (add_quads)
    for (int g = 0; g < DIGITS; ++g)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < MB; ++i) sum[g][h][i] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i first[2], second[2];
      for (int h = 0; h < 2; ++h) {
        __m256i p = _mm256_loadu_si256((const __m256i*)(wb + 64 * j + 32 * h));
        first[h] = _mm256_and_si256(p, nib);
        second[h] = _mm256_and_si256(_mm256_srli_epi16(p, 4), nib);
      }
      for (int i = 0; i < MB; ++i)
        for (int g = 0; g < DIGITS; ++g) {
          const int8_t* v = d.v + ((m0 + i) * d.B + b) * PER_BLOCK<F> + g * BLOCK;
          int32_t quads[2];  // columns 4j..4j+3 and 16+4j..16+4j+3
          std::memcpy(quads, v + 4 * j, 4);
          std::memcpy(quads + 1, v + 16 + 4 * j, 4);
          const __m256i q0 = _mm256_set1_epi32(quads[0]), q1 = _mm256_set1_epi32(quads[1]);
          for (int h = 0; h < 2; ++h) sum[g][h][i] = add_quads(sum[g][h][i], first[h], q0, second[h], q1);
        }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sg + b * 16 + 8 * h)));
      const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(lg + b * 16 + 8 * h)));
      for (int i = 0; i < MB; ++i) {
        const int64_t at = (m0 + i) * d.B + b;
        __m256 dot = _mm256_cvtepi32_ps(lane_dot(sum[0][h][i]));
        if constexpr (DIGITS == 2) dot = _mm256_fmadd_ps(dot, digit, _mm256_cvtepi32_ps(lane_dot(sum[1][h][i])));
        acc[h][i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(d.xs[at])), acc[h][i]);
        acc[h][i] = _mm256_fmadd_ps(low, _mm256_set1_ps(d.xsum[at]), acc[h][i]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t first = n0 + 8 * h;
    for (int i = 0; i < MB; ++i) store_rows(acc[h][i], N, first, out + (m0 + i) * N + first);
  }
}

// Rows m0..m0+MB of x against halves h0..h0+HALVES of the int8 group of sixteen weight rows starting at output row
// n0 (as int4_pass: both halves in one loop share each broadcast pair of v; a pass per half keeps more rows).
template <int MB, int HALVES>
void int8_pass(const int8_t* w, const float* scale, const Digits<Form::kWords>& d, int64_t m0, int h0, int64_t N,
               int64_t n0, float* out) {
  __m256 acc[HALVES][MB];
  for (int h = 0; h < HALVES; ++h)
    for (int i = 0; i < MB; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < d.B; ++b) {
    const int8_t* wb = w + b * 512;
    if (h0 == 0)
      for (int j = 0; j < 8; ++j) prefetch(wb + 64 * j + PREFETCH);
    __m256i dot[HALVES][MB];
    for (int h = 0; h < HALVES; ++h)
      for (int i = 0; i < MB; ++i) dot[h][i] = _mm256_setzero_si256();
    for (int c = 0; c < 16; ++c) {  // columns 2c, 2c + 1
      __m256i q[HALVES];
      for (int h = 0; h < HALVES; ++h)
        q[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wb + 32 * c + 16 * (h0 + h))));
      for (int i = 0; i < MB; ++i) {
        int32_t pair;
        std::memcpy(&pair, d.v + ((m0 + i) * d.B + b) * BLOCK + 2 * c, 4);
        const __m256i v = _mm256_set1_epi32(pair);
        for (int h = 0; h < HALVES; ++h) dot[h][i] = add_pairs(dot[h][i], q[h], v);
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m256 xs = _mm256_set1_ps(d.xs[(m0 + i) * d.B + b]);
      for (int h = 0; h < HALVES; ++h) acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][i]), xs, acc[h][i]);
    }
  }
  for (int h = 0; h < HALVES; ++h) {
    const int64_t first = n0 + 8 * (h0 + h);
    const __m256 s = _mm256_loadu_ps(scale + first);
    for (int i = 0; i < MB; ++i) store_rows(_mm256_mul_ps(acc[h][i], s), N, first, out + (m0 + i) * N + first);
  }
}

template <Form F>
struct Split {
  torch::Tensor v, xs, xsum;
  Digits<F> digits;
};

template <Form F>
Split<F> split_digits(const torch::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1), B = Kp / BLOCK;
  auto xc = x.contiguous();
  Split<F> s{torch::empty({M, B, PER_BLOCK<F>}, F == Form::kWords ? torch::kInt16 : torch::kInt8),
             torch::empty({M, B}, torch::kFloat32), torch::empty({M, B}, torch::kFloat32), {}};
  auto* v = static_cast<Digit<F>*>(s.v.data_ptr());
  auto* xs = static_cast<float*>(s.xs.data_ptr());
  auto* xsum = static_cast<float*>(s.xsum.data_ptr());
  split_rows<F>(xc.data_ptr<float>(), M, K, Kp, v, xs, xsum);
  s.digits = {v, xs, xsum, B};
  return s;
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: a 2-d float32 tensor");
}

void check_groups(int64_t N, int64_t G, int64_t rows) {
  TORCH_CHECK(N <= rows * G && N > rows * (G - 1), "N: ", N, " rows do not fill ", G, " groups of ", rows);
}

template <int DIGITS>
torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                      const torch::Tensor& low, int64_t N) {
  constexpr Form F = DIGITS == 2 ? Form::kHiLo : Form::kHi;
  check_x(x);
  TORCH_CHECK(codes.dim() == 5 && codes.size(2) == 4 && codes.size(3) == 16 && codes.size(4) == 4 &&
              codes.is_contiguous() && codes.scalar_type() == torch::kUInt8,
              "codes: a contiguous [N/16, K/32, 4, 16, 4] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), B = K / BLOCK, G = codes.size(0);
  TORCH_CHECK(K % BLOCK == 0 && codes.size(1) == B, "x: ", K, " columns; the codes hold ", codes.size(1),
              " blocks of 32");
  check_groups(N, G, 16);
  TORCH_CHECK(scale.is_contiguous() && low.is_contiguous() && scale.scalar_type() == torch::kFloat16 &&
              low.scalar_type() == torch::kFloat16 && scale.numel() == G * B * 16 && low.numel() == G * B * 16,
              "scale, low: contiguous [N/16, K/32, 16] float16 tensors");
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  Split<F> s = split_digits<F>(x, K);
  const uint8_t* W = codes.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* L = reinterpret_cast<const uint16_t*>(low.data_ptr<at::Half>());
  float* O = out.data_ptr<float>();
  tokenrouter::over_groups<DIGITS == 2 ? MAX_ROWS_INT4 : MAX_ROWS_A8>(G, M, [&](int64_t g, int64_t m, auto rows) {
    constexpr int MB = decltype(rows)::value;
    int4_pass<MB, F>(W + g * B * 256, S + g * B * 16, L + g * B * 16, s.digits, m, N, g * 16, O);
  });
  return out;
}

torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale, int64_t N) {
  check_x(x);
  TORCH_CHECK(codes.dim() == 5 && codes.size(2) == 16 && codes.size(3) == 16 && codes.size(4) == 2 &&
              codes.is_contiguous() && codes.scalar_type() == torch::kInt8,
              "codes: a contiguous [N/16, Kp/32, 16, 16, 2] int8 tensor");
  const int64_t M = x.size(0), K = x.size(1), B = codes.size(1), G = codes.size(0);
  TORCH_CHECK(B == (K + BLOCK - 1) / BLOCK, "x: ", K, " columns; the codes hold ", B, " blocks of 32");
  check_groups(N, G, 16);
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32 && scale.numel() == 16 * G,
              "scale: a contiguous [N/16 * 16] float32 tensor");
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  Split<Form::kWords> s = split_digits<Form::kWords>(x, B * BLOCK);
  const int8_t* W = codes.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  float* O = out.data_ptr<float>();
  tokenrouter::over_groups<MAX_ROWS_INT8>(G, M, [&](int64_t g, int64_t m, auto rows) {
    constexpr int MB = decltype(rows)::value;
    if constexpr (MB <= BOTH_HALVES_INT8) {
      int8_pass<MB, 2>(W + g * B * 512, S, s.digits, m, 0, N, g * 16, O);
    } else {
      for (int h = 0; h < 2; ++h) int8_pass<MB, 1>(W + g * B * 512, S, s.digits, m, h, N, g * 16, O);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm<2>, "x [M, K] float32 (two digits) times int4 weights in groups of sixteen rows");
  m.def("int4_mm_a8", &int4_mm<1>, "x [M, K] float32 (one int8 digit) times int4 weights in groups of sixteen rows");
  m.def("int8_mm", &int8_mm, "x [M, K] float32 times int8 weights in groups of sixteen rows -> [M, N] float32");
}
