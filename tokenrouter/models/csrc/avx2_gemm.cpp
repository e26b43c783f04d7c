// int4 and int8 weights times fp32 activations with AVX2 integer dot products (vpmaddwd): the `int4-avx2` and
// `int8-avx2` kernels, built by `tokenrouter.models.native` at first use with AVX2-level flags only (-mavx2 -mfma
// -mf16c), so the object runs on any CPU with those.
//
// Activations as int4-vnni takes them (csrc/int4_vnni.cpp): each row split per block of 32 columns into two
// int8 digits, x ~ xs * (254 * hi + lo), about 15 bits; here the two are one int16, v = 254 hi + lo. vpmaddwd
// multiplies 16-bit weights by v and sums pairs into int32 lanes: 16 products per instruction and nothing to
// saturate (vpmaddubsw takes 32 but saturates its int16 pairs, needs a second instruction per digit and one more
// to widen: 12 multiplies per block of four rows where vpmaddwd takes 8).
//
// int4: int4-vnni's layout and arithmetic, bit for bit: its lanes of four plus four columns are summed in int32
// (the same integers, below 2^24), then the same fp32 operations in the same order, the zero's term too:
//   y[n] = sum_b  scale[n,b] * xs[b] * sum_j code[n,b,j] * (254 hi[b,j] + lo[b,j])  +  low[n,b] * sum_j x[b,j]
//   codes: [N/4, K/32, 4, 16] uint8 (row r's 16 bytes: column j in the low nibble, j+16 in the high one)
//   scale, low: [N/4, K/32, 4] float16
// int8: signed codes (-128 included), one fp32 scale per output row:
//   y[n] = scale[n] * sum_b xs[b] * sum_j w[n,b,j] * (254 hi[b,j] + lo[b,j])
//   codes: [N/4, Kp/32, 2, 4, 2, 8] int8: per block, rows (0, 1) then (2, 3); per pair the four slots of 8 columns
//   (see slot_order) of both rows; Kp is K rounded up to 32 (the weights zero beyond K, the activations too)
// Weights are read once per call whatever the batch: a block's weights are widened to int16 once for ROWS rows
// of x, and a group of four weight rows stays in L1 while the rest of x passes over it. A row's result does not
// depend on the other rows of the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr float DIGIT = 254.f;  // the high digit's weight: the remainder of hi spans [-127, 127] in lo
constexpr int64_t BLOCK = 32;
// rows of x per pass over a block's widened weights (register blocking); 4 measured 1.1-1.4x faster per row than
// 2 at 4-16 rows, 8 no faster than 4 (Intel Xeon, one thread)
constexpr int ROWS = 4;

// NOTE: the 16-bit operands of a block, in slots of 8 columns: the pairs (4j, 4j+1) of its first 16 columns, the
// pairs (4j+2, 4j+3), then the same of columns 16-31. vpmaddwd sums a pair into an int32 lane, and adding the
// four slots' lanes sums columns 4j..4j+3 and 16+4j..16+4j+3: int4-vnni's lane j.
inline __m256i slot_order(__m256i v32a, __m256i v32b) {
  // sixteen int32 (columns 0-15 of a block's half) -> int16 [P | Q]: P the pairs (4j, 4j+1), Q (4j+2, 4j+3)
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi32(v32a, v32b), _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7));
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

// x [M, K] -> v [M, Kp/32, 4 slots, 2, 8] int16 (each slot's 8 values in both 128-bit lanes, as the weight
// registers hold two rows), xs and xsum [M, Kp/32]; a last partial block is read as if zero-padded.
// v = 254 hi + lo: int4-vnni's two digits as one int16 (|v| <= 32385).
void split_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int16_t* v, float* xs, float* xsum) {
  const int64_t B = Kp / BLOCK;
  at::parallel_for(0, M * B, 512, [&](int64_t i0, int64_t i1) {
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
      __m256i d[4];
      for (int h = 0; h < 4; ++h) {
        __m256 t = _mm256_mul_ps(a[h], inv);
        __m256i q = _mm256_cvtps_epi32(t);  // to nearest even (the default rounding mode), as int4-vnni
        __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, _mm256_cvtepi32_ps(q)), digit));
        d[h] = _mm256_add_epi32(_mm256_mullo_epi32(q, _mm256_set1_epi32(254)), r);
      }
      __m256i* out = (__m256i*)(v + i * 4 * 16);
      for (int half = 0; half < 2; ++half) {
        __m256i pq = slot_order(d[2 * half], d[2 * half + 1]);
        _mm256_storeu_si256(out + 2 * half, _mm256_permute2x128_si256(pq, pq, 0x00));
        _mm256_storeu_si256(out + 2 * half + 1, _mm256_permute2x128_si256(pq, pq, 0x11));
      }
      xs[i] = amax / (127.f * DIGIT);
      xsum[i] = block_sum(a);
    }
  });
}

struct Digits {  // one split batch of x
  const int16_t* v;
  const float* xs;
  const float* xsum;
  int64_t B;
};

inline float lane_sum(const float* lanes) { return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]); }

// One row's int32 lanes of a block for a pair of weight rows: w [4 slots] int16, v the row's block [4 slots].
inline __m256i pair_dot(const __m256i w[4], const int16_t* v) {
  const __m256i* x = (const __m256i*)v;
  __m256i first = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(x)),
                                   _mm256_madd_epi16(w[1], _mm256_loadu_si256(x + 1)));
  __m256i second = _mm256_add_epi32(_mm256_madd_epi16(w[2], _mm256_loadu_si256(x + 2)),
                                    _mm256_madd_epi16(w[3], _mm256_loadu_si256(x + 3)));
  return _mm256_add_epi32(first, second);
}

// Rows m0..m0+MB of x against the int4 group of four weight rows starting at output row n0.
template <int MB>
void int4_group(const uint8_t* w, const uint16_t* sg, const uint16_t* lg, const Digits& d, int64_t m0, int64_t N,
                int64_t n0, float* out) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i P = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1,
                                     0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
  const __m256i Q = _mm256_add_epi8(P, _mm256_setr_epi8(2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0,
                                                         2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0));
  const __m256i pair01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), pair23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  __m256 acc[MB][2];
  __m128 acc_low[MB];
  for (int i = 0; i < MB; ++i) {
    acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    acc_low[i] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < d.B; ++b) {
    __m256 s4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(sg + b * 4))));
    __m256 scale[2] = {_mm256_permutevar8x32_ps(s4, pair01), _mm256_permutevar8x32_ps(s4, pair23)};
    __m128 low = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(lg + b * 4)));
    for (int r = 0; r < 2; ++r) {  // rows (0, 1), then (2, 3): one 128-bit lane each
      __m256i p = _mm256_loadu_si256((const __m256i*)(w + b * 64 + 32 * r));
      __m256i first = _mm256_and_si256(p, nib), second = _mm256_and_si256(_mm256_srli_epi16(p, 4), nib);
      __m256i u[4] = {_mm256_shuffle_epi8(first, P), _mm256_shuffle_epi8(first, Q), _mm256_shuffle_epi8(second, P),
                      _mm256_shuffle_epi8(second, Q)};
      for (int i = 0; i < MB; ++i) {
        const int64_t at = (m0 + i) * d.B + b;
        __m256i dot = pair_dot(u, d.v + at * 64);  // below 2^24: exact in fp32, as int4-vnni's 254 dh + dl
        __m256 sx = _mm256_mul_ps(scale[r], _mm256_set1_ps(d.xs[at]));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sx, acc[i][r]);
      }
    }
    for (int i = 0; i < MB; ++i) acc_low[i] = _mm_fmadd_ps(low, _mm_set1_ps(d.xsum[(m0 + i) * d.B + b]), acc_low[i]);
  }
  for (int i = 0; i < MB; ++i) {
    alignas(32) float lanes[16];
    alignas(16) float lows[4];
    _mm256_store_ps(lanes, acc[i][0]);
    _mm256_store_ps(lanes + 8, acc[i][1]);
    _mm_store_ps(lows, acc_low[i]);
    for (int r = 0; r < 4 && n0 + r < N; ++r) out[(m0 + i) * N + n0 + r] = lane_sum(lanes + 4 * r) + lows[r];
  }
}

// Rows m0..m0+MB of x against the int8 group of four weight rows starting at output row n0.
template <int MB>
void int8_group(const int8_t* w, const float* scale, const Digits& d, int64_t m0, int64_t N, int64_t n0, float* out) {
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < d.B; ++b) {
    for (int r = 0; r < 2; ++r) {
      __m256i u[4];
      for (int k = 0; k < 4; ++k)
        u[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + b * 128 + 64 * r + 16 * k)));
      for (int i = 0; i < MB; ++i) {
        const int64_t at = (m0 + i) * d.B + b;
        // a lane sums 8 products of at most 128 * 32385: up to 2^25, rounded to fp32 by at most 2^-24 of itself
        __m256i dot = pair_dot(u, d.v + at * 64);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d.xs[at]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, acc[i][0]);
    _mm256_store_ps(lanes + 8, acc[i][1]);
    for (int r = 0; r < 4 && n0 + r < N; ++r) out[(m0 + i) * N + n0 + r] = scale[n0 + r] * lane_sum(lanes + 4 * r);
  }
}

struct Split {
  torch::Tensor v, xs, xsum;
  Digits digits;
};

Split split_digits(const torch::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1), B = Kp / BLOCK;
  auto xc = x.contiguous();
  Split s{torch::empty({M, B, 64}, torch::kInt16), torch::empty({M, B}, torch::kFloat32),
          torch::empty({M, B}, torch::kFloat32), {}};
  split_rows(xc.data_ptr<float>(), M, K, Kp, s.v.data_ptr<int16_t>(), s.xs.data_ptr<float>(), s.xsum.data_ptr<float>());
  s.digits = {s.v.data_ptr<int16_t>(), s.xs.data_ptr<float>(), s.xsum.data_ptr<float>(), B};
  return s;
}

// Each group of four weight rows once, all rows of x over it: ROWS at a time, then two, then one.
template <typename Group>
void over_groups(int64_t G, int64_t M, const Group& group) {
  at::parallel_for(0, G, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t m = 0;
      for (; m + ROWS <= M; m += ROWS) group(g, m, std::integral_constant<int, ROWS>{});
      for (; m + 2 <= M; m += 2) group(g, m, std::integral_constant<int, 2>{});
      for (; m < M; ++m) group(g, m, std::integral_constant<int, 1>{});
    }
  });
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: a 2-d float32 tensor");
}

void check_groups(int64_t N, int64_t G) {
  TORCH_CHECK(N <= 4 * G && N > 4 * (G - 1), "N: ", N, " rows do not fill ", G, " groups of four");
}

}  // namespace

torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                      const torch::Tensor& low, int64_t N) {
  check_x(x);
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == 4 && codes.size(3) == 16 && codes.is_contiguous() &&
              codes.scalar_type() == torch::kUInt8, "codes: a contiguous [N/4, K/32, 4, 16] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), B = K / BLOCK, G = codes.size(0);
  TORCH_CHECK(K % BLOCK == 0 && codes.size(1) == B, "x: ", K, " columns; the codes hold ", codes.size(1), " blocks of 32");
  check_groups(N, G);
  TORCH_CHECK(scale.is_contiguous() && low.is_contiguous() && scale.scalar_type() == torch::kFloat16 &&
              low.scalar_type() == torch::kFloat16 && scale.numel() == G * B * 4 && low.numel() == G * B * 4,
              "scale, low: contiguous [N/4, K/32, 4] float16 tensors");
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  Split s = split_digits(x, K);
  const uint8_t* W = codes.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* L = reinterpret_cast<const uint16_t*>(low.data_ptr<at::Half>());
  float* O = out.data_ptr<float>();
  over_groups(G, M, [&](int64_t g, int64_t m, auto rows) {
    int4_group<decltype(rows)::value>(W + g * B * 64, S + g * B * 4, L + g * B * 4, s.digits, m, N, g * 4, O);
  });
  return out;
}

torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale) {
  check_x(x);
  TORCH_CHECK(codes.dim() == 6 && codes.size(2) == 2 && codes.size(3) == 4 && codes.size(4) == 2 &&
              codes.size(5) == 8 && codes.is_contiguous() && codes.scalar_type() == torch::kInt8,
              "codes: a contiguous [N/4, Kp/32, 2, 4, 2, 8] int8 tensor");
  const int64_t M = x.size(0), K = x.size(1), B = codes.size(1), G = codes.size(0), N = scale.numel();
  TORCH_CHECK(B == (K + BLOCK - 1) / BLOCK, "x: ", K, " columns; the codes hold ", B, " blocks of 32");
  check_groups(N, G);
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32, "scale: a contiguous [N] float32 tensor");
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  Split s = split_digits(x, B * BLOCK);
  const int8_t* W = codes.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  float* O = out.data_ptr<float>();
  over_groups(G, M, [&](int64_t g, int64_t m, auto rows) {
    int8_group<decltype(rows)::value>(W + g * B * 128, S, s.digits, m, N, g * 4, O);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm, "x [M, K] float32 times int4 weights in groups of four rows -> [M, N] float32");
  m.def("int8_mm", &int8_mm, "x [M, K] float32 times int8 weights in groups of four rows -> [M, N] float32");
}
