// int4 and int8 weights times fp32 activations with AVX2 integer dot products (vpmaddwd): the `int4-avx2`,
// `int4-avx2-a8` and `int8-avx2` kernels, built by `tokenrouter.models.native` at first use with AVX2-level
// flags only (-mavx2 -mfma -mf16c), so the object runs on any CPU with those.
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
// int4-avx2-a8: int4-vnni-a8's arithmetic, bit for bit: the high digit alone (x ~ xs * hi, xs = amax / 127), as
// int8; vpmaddubsw multiplies the unsigned codes by it (pairs of at most 2 * 15 * 127: nothing saturates), and
// one vpmaddwd by ones sums int4-vnni's lanes: no widening of the codes, half the multiplies.
// int8: signed codes (-128 included), one fp32 scale per output row:
//   y[n] = scale[n] * sum_b xs[b] * sum_j w[n,b,j] * (254 hi[b,j] + lo[b,j])
//   codes: [N/4, Kp/32, 2, 4, 2, 8] int8: per block, rows (0, 1) then (2, 3); per pair the four slots of 8 columns
//   (see slot_order) of both rows; Kp is K rounded up to 32 (the weights zero beyond K, the activations too)
// Weights are read once per call whatever the batch. A group of four weight rows is taken as two pairs (one
// 256-bit register holds a block's 8 columns of both rows of a pair): a pair's block is widened to int16 once
// and applied to up to MAX_ROWS rows of x, each row's accumulator in a register (a batch of 1-16 rows takes
// 1-3 such passes, split evenly); the group stays in L1 while the passes read it again. A row's result does not
// depend on the other rows of the batch.
#include <torch/extension.h>
#include "parallel.h"
#include <immintrin.h>

#include <cstring>
#include <type_traits>

namespace {

constexpr float DIGIT = 254.f;  // the high digit's weight: the remainder of hi spans [-127, 127] in lo
constexpr int64_t BLOCK = 32;
// rows of x per pass over a pair's widened weights: one accumulator register each, besides the pair's four
// weight registers and a few temporaries, within AVX2's sixteen. 6 takes a verifying step of 5 rows in one pass;
// 4 and 8 measured no faster at 1-16 rows (Intel Xeon, one thread)
constexpr int MAX_ROWS = 6;
// int8: both pairs of a block a loop, two accumulators a row (see int8_group)
constexpr int MAX_ROWS_INT8 = 3;
// NOTE: how far ahead of the weights being read they are prefetched, in bytes (32 int4 blocks, 16 int8 ones).
// The weights stream from memory once per call, and the hardware prefetchers alone left a core at 6.7 GB/s:
// an int4 17920x1536 projection at one row took 2.41 ms on one thread without, 1.01 with (1024 ahead: 1.22,
// 4096: 1.27); the 151936x1536 lm_head 20.6 -> 11.8 ms, 11.7 -> 5.2 on two threads (Intel Xeon, 480 MiB L3,
// 2026-12-05). A prefetch past the end of the weights is harmless: it never faults.
constexpr int64_t PREFETCH = 2048;

__attribute__((always_inline)) inline void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }

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

// The activations' digits: two as one int16 (v = 254 hi + lo, |v| <= 32385), or the high one alone as an int8.
template <int DIGITS>
using Digit = std::conditional_t<DIGITS == 2, int16_t, int8_t>;

// x [M, K] -> v [M, Kp/32, 32], xs and xsum [M, Kp/32]; a last partial block is read as if zero-padded.
// DIGITS 2: v = 254 hi + lo, int4-vnni's two digits as one int16, in 4 slots of 8 (slot_order; a slot is
// broadcast to both 128-bit lanes as it is loaded, as the weight registers hold two rows). DIGITS 1: v = hi,
// int4-vnni-a8's digit, as int8 in column order.
template <int DIGITS>
void split_rows(const float* x, int64_t M, int64_t K, int64_t Kp, Digit<DIGITS>* v, float* xs, float* xsum) {
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
      __m256i d[4];
      for (int h = 0; h < 4; ++h) {
        __m256 t = _mm256_mul_ps(a[h], inv);
        __m256i q = _mm256_cvtps_epi32(t);  // to nearest even (the default rounding mode), as int4-vnni
        if constexpr (DIGITS == 2) {
          __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, _mm256_cvtepi32_ps(q)), digit));
          d[h] = _mm256_add_epi32(_mm256_mullo_epi32(q, _mm256_set1_epi32(254)), r);
        } else {
          d[h] = q;
        }
      }
      __m256i* out = (__m256i*)(v + i * BLOCK);
      if constexpr (DIGITS == 2) {
        for (int half = 0; half < 2; ++half) _mm256_storeu_si256(out + half, slot_order(d[2 * half], d[2 * half + 1]));
      } else {
        // the packs interleave 128-bit lanes: lane 0 holds d[h][0..3] of each h, lane 1 d[h][4..7]
        __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(d[0], d[1]), _mm256_packs_epi32(d[2], d[3]));
        _mm256_storeu_si256(out, _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      }
      xs[i] = DIGITS == 2 ? amax / (127.f * DIGIT) : amax / 127.f;
      xsum[i] = block_sum(a);
    }
  });
}

template <int DIGITS>
struct Digits {  // one split batch of x
  const Digit<DIGITS>* v;
  const float* xs;
  const float* xsum;
  int64_t B;
};

inline float lane_sum(const float* lanes) { return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]); }

// slot k of a row's block in both 128-bit lanes (vbroadcasti128: a load, no shuffle)
inline __m256i slot(const int16_t* v, int k) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(v + 8 * k)));
}

// One row's int32 lanes of a block for a pair of weight rows: w [4 slots] int16, v the row's block [4 slots].
inline __m256i pair_dot(const __m256i w[4], const int16_t* v) {
  __m256i first = _mm256_add_epi32(_mm256_madd_epi16(w[0], slot(v, 0)), _mm256_madd_epi16(w[1], slot(v, 1)));
  __m256i second = _mm256_add_epi32(_mm256_madd_epi16(w[2], slot(v, 2)), _mm256_madd_epi16(w[3], slot(v, 3)));
  return _mm256_add_epi32(first, second);
}

// A pair of int4 weight rows' block (32 bytes: row 0's 16 in the low 128-bit lane, row 1's in the high one) as
// a row of x's digits take it, and that row's int32 lanes of the block (below 2^24: exact in fp32, as
// int4-vnni's): int4-vnni's lane j, columns 4j..4j+3 and 16+4j..16+4j+3 of the block.
template <int DIGITS>
struct PairCodes;

// two digits: four slots of int16 (slot_order's pairs of columns)
template <>
struct PairCodes<2> {
  __m256i u[4];

  explicit PairCodes(const uint8_t* w) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i P = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1,
                                       0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
    const __m256i Q = _mm256_setr_epi8(2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1,
                                       2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1);
    __m256i p = _mm256_loadu_si256((const __m256i*)w);
    __m256i first = _mm256_and_si256(p, nib), second = _mm256_and_si256(_mm256_srli_epi16(p, 4), nib);
    u[0] = _mm256_shuffle_epi8(first, P);
    u[1] = _mm256_shuffle_epi8(first, Q);
    u[2] = _mm256_shuffle_epi8(second, P);
    u[3] = _mm256_shuffle_epi8(second, Q);
  }

  __m256i dot(const int16_t* v) const { return pair_dot(u, v); }
};

// one digit: the codes of columns 0-15 and 16-31 as unsigned bytes, against the row's int8 digit broadcast to
// both 128-bit lanes
template <>
struct PairCodes<1> {
  __m256i first, second;

  explicit PairCodes(const uint8_t* w) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    __m256i p = _mm256_loadu_si256((const __m256i*)w);
    first = _mm256_and_si256(p, nib);
    second = _mm256_and_si256(_mm256_srli_epi16(p, 4), nib);
  }

  __m256i dot(const int8_t* v) const {
    __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)v));
    __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(v + 16)));
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, lo), _mm256_maddubs_epi16(second, hi));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
};

// A pair's two fp16 scales of a block over its lanes: row 0's in lanes 0-3, row 1's in 4-7.
inline __m256 pair_scale(const uint16_t* s) {
  int32_t two;
  std::memcpy(&two, s, sizeof two);
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two))),
                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// A group's int4 weights from block b on: its line of codes PREFETCH bytes ahead, and every eighth block the
// line of scales and of zeros as far ahead (8 bytes a block each).
// NOTE: always inlined: GCC 12 found a plain inline function of prefetches alone free of side effects and
// dropped its calls (no prefetch was left in the int4 loops)
__attribute__((always_inline)) inline void prefetch_int4(const uint8_t* w, const uint16_t* sg, const uint16_t* lg,
                                                         int64_t b) {
  prefetch(w + b * 64 + PREFETCH);
  if ((b & 7) == 0) prefetch(sg + b * 4 + PREFETCH / 8);
  if ((b & 7) == 4) prefetch(lg + b * 4 + PREFETCH / 8);
}

// The zero's term of rows m0..m0+MB against a group's four weight rows: acc[i] += sum_b low[b] * xsum[i, b].
template <int MB, int DIGITS>
void int4_lows(const uint16_t* lg, const Digits<DIGITS>& d, int64_t m0, __m128 acc[MB]) {
  for (int64_t b = 0; b < d.B; ++b) {
    __m128 low = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(lg + b * 4)));
    for (int i = 0; i < MB; ++i) acc[i] = _mm_fmadd_ps(low, _mm_set1_ps(d.xsum[(m0 + i) * d.B + b]), acc[i]);
  }
}

// One pass of rows m0..m0+MB of x over pair r of an int4 group (rows 2r, 2r+1): acc[i] the row's lanes. With LOW
// the zero's term of all four weight rows is summed in the same loop (lows[i]).
// NOTE: each row's zero term is a chain of fmas, one per block (4 cycles each); for one to three rows that
// chain would bound a loop of its own, so it rides in the first pass; from four rows on it has its own loop.
template <int MB, bool LOW, int DIGITS>
void int4_pass(const uint8_t* w, const uint16_t* sg, const uint16_t* lg, const Digits<DIGITS>& d, int64_t m0, int r,
               __m256 acc[MB], __m128 lows[MB]) {
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < d.B; ++b) {
    prefetch_int4(w, sg, lg, b);
    __m256 scale = pair_scale(sg + b * 4 + 2 * r);
    const PairCodes<DIGITS> codes(w + b * 64 + 32 * r);
    __m128 low;
    if constexpr (LOW) low = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(lg + b * 4)));
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * d.B + b;
      __m256i dot = codes.dot(d.v + at * BLOCK);
      __m256 sx = _mm256_mul_ps(scale, _mm256_set1_ps(d.xs[at]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sx, acc[i]);
      if constexpr (LOW) lows[i] = _mm_fmadd_ps(low, _mm_set1_ps(d.xsum[at]), lows[i]);
    }
  }
}

// Rows m0..m0+MB of x against the int4 group of four weight rows starting at output row n0: rows (0, 1), then
// (2, 3), a pair's block unpacked once for all MB rows (MB > 1; one row: int4_row).
template <int MB, int DIGITS>
void int4_group(const uint8_t* w, const uint16_t* sg, const uint16_t* lg, const Digits<DIGITS>& d, int64_t m0,
                int64_t N, int64_t n0, float* out) {
  constexpr bool inline_low = MB <= 3;
  __m128 low_acc[MB];
  for (int i = 0; i < MB; ++i) low_acc[i] = _mm_setzero_ps();
  if constexpr (!inline_low) int4_lows<MB>(lg, d, m0, low_acc);
  for (int r = 0; r < 2; ++r) {
    __m256 acc[MB];
    if (inline_low && r == 0) int4_pass<MB, inline_low>(w, sg, lg, d, m0, r, acc, low_acc);
    else int4_pass<MB, false>(w, sg, lg, d, m0, r, acc, low_acc);
    for (int i = 0; i < MB; ++i) {
      alignas(32) float lanes[8];
      alignas(16) float lows[4];
      _mm256_store_ps(lanes, acc[i]);
      _mm_store_ps(lows, low_acc[i]);
      for (int h = 0; h < 2; ++h) {
        const int64_t n = n0 + 2 * r + h;
        if (n < N) out[(m0 + i) * N + n] = lane_sum(lanes + 4 * h) + lows[2 * r + h];
      }
    }
  }
}

// One row: both pairs in one loop (a pass each would run two loops of one accumulator chain), the zero's term too.
template <int DIGITS>
void int4_row(const uint8_t* w, const uint16_t* sg, const uint16_t* lg, const Digits<DIGITS>& d, int64_t m0,
              int64_t N, int64_t n0, float* out) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m128 low_acc = _mm_setzero_ps();
  for (int64_t b = 0; b < d.B; ++b) {
    prefetch_int4(w, sg, lg, b);
    const int64_t at = m0 * d.B + b;
    const __m256 xs = _mm256_set1_ps(d.xs[at]);
    for (int r = 0; r < 2; ++r) {
      __m256i dot = PairCodes<DIGITS>(w + b * 64 + 32 * r).dot(d.v + at * BLOCK);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(pair_scale(sg + b * 4 + 2 * r), xs), acc[r]);
    }
    __m128 low = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(lg + b * 4)));
    low_acc = _mm_fmadd_ps(low, _mm_set1_ps(d.xsum[at]), low_acc);
  }
  alignas(16) float lows[4];
  _mm_store_ps(lows, low_acc);
  for (int r = 0; r < 2; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + 2 * r + h;
      if (n < N) out[m0 * N + n] = lane_sum(lanes + 4 * h) + lows[2 * r + h];
    }
  }
}

// A pair of int8 weight rows' block (64 bytes: per slot row 0's 8 then row 1's) -> its four slots of int16.
inline void widen_pair8(const int8_t* w, __m256i u[4]) {
  for (int k = 0; k < 4; ++k) u[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16 * k)));
}

// a lane sums 8 products of at most 128 * 32385: up to 2^25, rounded to fp32 by at most 2^-24 of itself
inline __m256 int8_step(const __m256i u[4], const Digits<2>& d, int64_t at, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(u, d.v + at * BLOCK)), _mm256_set1_ps(d.xs[at]), acc);
}

inline void int8_store(__m256 acc, const float* scale, int64_t m, int64_t N, int64_t n0, float* out) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (int h = 0; h < 2; ++h)
    if (n0 + h < N) out[m * N + n0 + h] = scale[n0 + h] * lane_sum(lanes + 4 * h);
}

// Rows m0..m0+MB of x against the int8 group of four weight rows starting at output row n0: both pairs of a block
// in one loop (its 128 bytes read in order), two accumulators a row.
// NOTE: a pass per pair (as int4) read every other cache line of the weights and measured 1.1-1.3x slower at
// one and two rows; a layout with each pair's blocks in a row slowed one row instead (two streams)
template <int MB>
void int8_group(const int8_t* w, const float* scale, const Digits<2>& d, int64_t m0, int64_t N, int64_t n0,
                float* out) {
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < d.B; ++b) {
    prefetch(w + b * 128 + PREFETCH);
    prefetch(w + b * 128 + PREFETCH + 64);
    for (int r = 0; r < 2; ++r) {
      __m256i u[4];
      widen_pair8(w + b * 128 + r * 64, u);
      for (int i = 0; i < MB; ++i) acc[i][r] = int8_step(u, d, (m0 + i) * d.B + b, acc[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < 2; ++r) int8_store(acc[i][r], scale, m0 + i, N, n0 + 2 * r, out);
}

template <int DIGITS>
struct Split {
  torch::Tensor v, xs, xsum;
  Digits<DIGITS> digits;
};

template <int DIGITS>
Split<DIGITS> split_digits(const torch::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1), B = Kp / BLOCK;
  auto xc = x.contiguous();
  Split<DIGITS> s{torch::empty({M, B, BLOCK}, DIGITS == 2 ? torch::kInt16 : torch::kInt8),
                  torch::empty({M, B}, torch::kFloat32), torch::empty({M, B}, torch::kFloat32), {}};
  auto* v = static_cast<Digit<DIGITS>*>(s.v.data_ptr());
  auto* xs = static_cast<float*>(s.xs.data_ptr());
  auto* xsum = static_cast<float*>(s.xsum.data_ptr());
  split_rows<DIGITS>(xc.data_ptr<float>(), M, K, Kp, v, xs, xsum);
  s.digits = {v, xs, xsum, B};
  return s;
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: a 2-d float32 tensor");
}

void check_groups(int64_t N, int64_t G) {
  TORCH_CHECK(N <= 4 * G && N > 4 * (G - 1), "N: ", N, " rows do not fill ", G, " groups of four");
}

template <int DIGITS>
torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                      const torch::Tensor& low, int64_t N) {
  check_x(x);
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == 4 && codes.size(3) == 16 && codes.is_contiguous() &&
              codes.scalar_type() == torch::kUInt8, "codes: a contiguous [N/4, K/32, 4, 16] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), B = K / BLOCK, G = codes.size(0);
  TORCH_CHECK(K % BLOCK == 0 && codes.size(1) == B, "x: ", K, " columns; the codes hold ", codes.size(1),
              " blocks of 32");
  check_groups(N, G);
  TORCH_CHECK(scale.is_contiguous() && low.is_contiguous() && scale.scalar_type() == torch::kFloat16 &&
              low.scalar_type() == torch::kFloat16 && scale.numel() == G * B * 4 && low.numel() == G * B * 4,
              "scale, low: contiguous [N/4, K/32, 4] float16 tensors");
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  Split<DIGITS> s = split_digits<DIGITS>(x, K);
  const uint8_t* W = codes.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* L = reinterpret_cast<const uint16_t*>(low.data_ptr<at::Half>());
  float* O = out.data_ptr<float>();
  tokenrouter::over_groups<MAX_ROWS>(G, M, [&](int64_t g, int64_t m, auto rows) {
    constexpr int MB = decltype(rows)::value;
    if constexpr (MB == 1) int4_row(W + g * B * 64, S + g * B * 4, L + g * B * 4, s.digits, m, N, g * 4, O);
    else int4_group<MB, DIGITS>(W + g * B * 64, S + g * B * 4, L + g * B * 4, s.digits, m, N, g * 4, O);
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
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32,
              "scale: a contiguous [N] float32 tensor");
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  Split<2> s = split_digits<2>(x, B * BLOCK);
  const int8_t* W = codes.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  float* O = out.data_ptr<float>();
  tokenrouter::over_groups<MAX_ROWS_INT8>(G, M, [&](int64_t g, int64_t m, auto rows) {
    int8_group<decltype(rows)::value>(W + g * B * 128, S, s.digits, m, N, g * 4, O);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm<2>, "x [M, K] float32 (two digits) times int4 weights in groups of four rows");
  m.def("int4_mm_a8", &int4_mm<1>, "x [M, K] float32 (one int8 digit) times int4 weights in groups of four rows");
  m.def("int8_mm", &int8_mm, "x [M, K] float32 times int8 weights in groups of four rows -> [M, N] float32");
}
