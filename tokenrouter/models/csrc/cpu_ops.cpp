// The small operations of a decoder layer on a CPU, each one call where torch takes several: `cpu-ops`, built by
// `tokenrouter.models.native` at first use with AVX2-level flags only (-mavx2 -mfma -mf16c).
//
// On two cores a decode step of the 0.5B (int4) spent about 8 of its 22 ms outside the projections: some 25 torch
// ops a layer at 2-10 us each (torch's rms_norm alone is six), and attention gathering each row's whole context
// into a dense tensor before two matmuls and a softmax. Here:
//   rms_norm(x, w, eps)                    -> x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm(x, delta, w, eps)         -> (x + delta, rms_norm(x + delta))
//   silu_mul(gate_up)                      -> silu(gate) * up, gate and up the two halves of each row
//   rope_store_(qk, v, cos, sin, k_cache, v_cache, slots)
//       rotates q and k (qk's heads) in place by each token's row of the rotary table (layers.py's cos and sin)
//       and writes k and v to their cache slots
//   paged_attention_(out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len)
//       causal attention of every token of the chunks of at most max_query_len tokens, reading the paged cache
//       [num_blocks, block_size, kv_heads, head_dim] in place (fp32 or bf16); the query heads of a kv head share
//       each key and value as it is read (GQA); the other chunks' rows of `out` are left as they were.
// Activations are fp32. A token's results do not depend on the other tokens of the step: a verifying chunk's
// last token attends exactly as the same token decoded alone would.
#include <torch/extension.h>
#include "parallel.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// exp for x <= 88 (Cephes' expf: a degree-6 polynomial on [-ln2/2, ln2/2] times 2^n), about 1 ulp: x clamped to
// [EXP_MIN, EXP_MAX], n = floor(x log2(e) + 1/2), r = x - n ln2 (ln2 in two parts), y = poly(r) r^2 + r + 1, times
// 2^n. The scalar form for loops the compiler vectorizes, silu_mul8's for eight lanes.
constexpr float EXP_MIN = -87.3f, EXP_MAX = 88.3f, LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;  // ln2 = LN2_HI + LN2_LO, LN2_HI exact in 9 bits
constexpr float EXP_POLY[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                              1.6666665459e-1f, 5.0000001201e-1f};  // highest degree first

// exp in a form the compiler vectorizes inside `omp simd` loops (libm's expf is a call per element), given
// -fno-trapping-math (tokenrouter/models/native.py): without it GCC keeps std::floor scalar and the loop with it.
inline float exp_approx(float x) {
  x = std::min(std::max(x, EXP_MIN), EXP_MAX);
  float n = std::floor(x * LOG2E + 0.5f);
  x = x - n * LN2_HI - n * LN2_LO;
  float y = EXP_POLY[0];
  for (int i = 1; i < 6; ++i) y = y * x + EXP_POLY[i];
  y = y * x * x + x + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T> inline T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline at::BFloat16 from_float<at::BFloat16>(float v) { return at::BFloat16(v); }  // to nearest even

// Rows of a few thousand floats each: a pool task only past this many elements in all.
constexpr int64_t PARALLEL_ELEMENTS = 1 << 16;

inline int64_t grain(int64_t rows, int64_t per_row) {
  return rows * per_row < PARALLEL_ELEMENTS ? rows : std::max<int64_t>(1, PARALLEL_ELEMENTS / per_row);
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, name,
              ": a 2-d float32 tensor with contiguous rows");
}

inline void norm_row(const float* x, const float* w, float eps, int64_t K, float* out) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < K; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / K + eps);
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) out[i] = x[i] * inv * w[i];
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.numel() == K && w.scalar_type() == torch::kFloat32, "w: ", K, " float32");
  auto out = torch::empty({M, K}, torch::kFloat32);
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  tokenrouter::parallel_for(0, M, grain(M, K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row(X + m * x.stride(0), W, (float)eps, K, O + m * K);
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                      const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(delta.size(0) == M && delta.size(1) == K, "delta: [", M, ", ", K, "] as x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == K && w.scalar_type() == torch::kFloat32, "w: ", K, " float32");
  auto sum = torch::empty({M, K}, torch::kFloat32), out = torch::empty({M, K}, torch::kFloat32);
  const float *X = x.data_ptr<float>(), *D = delta.data_ptr<float>(), *W = w.data_ptr<float>();
  float *S = sum.data_ptr<float>(), *O = out.data_ptr<float>();
  tokenrouter::parallel_for(0, M, grain(M, K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float *xm = X + m * x.stride(0), *dm = D + m * delta.stride(0);
      float* sm = S + m * K;
#pragma omp simd
      for (int64_t i = 0; i < K; ++i) sm[i] = xm[i] + dm[i];
      norm_row(sm, W, (float)eps, K, O + m * K);
    }
  });
  return {sum, out};
}

// g / (1 + exp_approx(-g)) * u in eight lanes, exp_approx's operations as GCC compiles them inside the loop it had
// here (its multiply-adds fused, and 1 + y * 2^n too): the same floats. NOTE: in intrinsics because GCC compiled that
// loop as two paths and a blend, one path dividing g by 1 + exp(88.3): a denormal quotient in nearly every lane,
// and each costs a microcode assist. 5 x 8960 columns took 72-79 us against 17-23 for torch's silu and product
// (AMD EPYC Zen 5); now 17.6, one row 15.0-16.5 -> 4.1 (docs/kernels.md, "Between the projections").
inline __m256 silu_mul8(__m256 g, __m256 u) {
  __m256 x = _mm256_sub_ps(_mm256_setzero_ps(), g);
  x = _mm256_min_ps(_mm256_set1_ps(EXP_MAX), _mm256_max_ps(_mm256_set1_ps(EXP_MIN), x));  // a NaN stays one
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x));
  __m256 y = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_POLY[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(y, x), x, x), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 one_plus_exp = _mm256_fmadd_ps(y, _mm256_castsi256_ps(bits), _mm256_set1_ps(1.f));
  return _mm256_mul_ps(_mm256_div_ps(g, one_plus_exp), u);
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "gate_up: an even number of columns");
  auto out = torch::empty({M, I}, torch::kFloat32);
  const float* G = gate_up.data_ptr<float>();
  float* O = out.data_ptr<float>();
  tokenrouter::parallel_for(0, M, grain(M, I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float *g = G + m * gate_up.stride(0), *u = g + I;
      float* o = O + m * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      if (i < I) {  // the last columns as eight, zero-padded
        alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
        std::copy(g + i, g + I, gt);
        std::copy(u + i, u + I, ut);
        _mm256_store_ps(ot, silu_mul8(_mm256_load_ps(gt), _mm256_load_ps(ut)));
        std::copy(ot, ot + (I - i), o + i);
      }
    }
  });
  return out;
}

void check_cache(const torch::Tensor& c, const char* name, int64_t heads, int64_t D) {
  TORCH_CHECK(c.dim() == 4 && c.is_contiguous() && c.size(2) == heads && c.size(3) == D &&
              (c.scalar_type() == torch::kFloat32 || c.scalar_type() == torch::kBFloat16),
              name, ": a contiguous [num_blocks, block_size, ", heads, ", ", D, "] float32 or bfloat16 tensor");
}

void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat32 && t.stride(2) == 1 && t.stride(1) == t.size(2),
              name, ": a [N, heads, head_dim] float32 tensor whose rows hold their heads contiguously");
}

template <typename T>
void rope_store_impl(torch::Tensor& qk, const torch::Tensor& v, const torch::Tensor& cos, const torch::Tensor& sin,
                     torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots) {
  const int64_t N = qk.size(0), H = qk.size(1), D = qk.size(2), Hkv = v.size(1), half = D / 2;
  float* QK = qk.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  const float *C = cos.data_ptr<float>(), *SN = sin.data_ptr<float>();
  const int64_t* S = slots.data_ptr<int64_t>();
  T *KC = k_cache.data_ptr<T>(), *VC = v_cache.data_ptr<T>();
  tokenrouter::parallel_for(0, N, grain(N, H * D), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float *c = C + n * cos.stride(0), *sn = SN + n * sin.stride(0);  // sn carries rotate-half's sign
      T *kslot = KC + S[n] * Hkv * D, *vslot = VC + S[n] * Hkv * D;
      for (int64_t h = 0; h < H; ++h) {
        float* x = QK + n * qk.stride(0) + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] + b * sn[i];
          x[i + half] = b * c[i + half] + a * sn[i + half];
        }
        if (h >= H - Hkv) {
          T* k = kslot + (h - (H - Hkv)) * D;
          for (int64_t i = 0; i < D; ++i) k[i] = from_float<T>(x[i]);
        }
      }
      const float* vn = V + n * v.stride(0);
      for (int64_t i = 0; i < Hkv * D; ++i) vslot[i] = from_float<T>(vn[i]);
    }
  });
}

void rope_store_(torch::Tensor qk, const torch::Tensor& v, const torch::Tensor& cos, const torch::Tensor& sin,
                 torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots) {
  check_heads(qk, "qk");
  check_heads(v, "v");
  const int64_t N = qk.size(0), D = qk.size(2), Hkv = v.size(1);
  TORCH_CHECK(v.size(0) == N && v.size(2) == D && qk.size(1) > Hkv && D % 2 == 0,
              "v: [N, kv_heads, head_dim] beside qk's [N, heads + kv_heads, head_dim]");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == N && t->size(1) == 1 && t->size(2) == D && t->stride(2) == 1 &&
                t->scalar_type() == torch::kFloat32, "cos, sin: [N, 1, head_dim] float32, each token's row");
  TORCH_CHECK(slots.numel() == N && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "slots: [N] contiguous int64");
  check_cache(k_cache, "k_cache", Hkv, D);
  check_cache(v_cache, "v_cache", Hkv, D);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "k_cache, v_cache: one shape and dtype");
  const int64_t* S = slots.data_ptr<int64_t>();
  for (int64_t n = 0, pool = k_cache.size(0) * k_cache.size(1); n < N; ++n)
    TORCH_CHECK(S[n] >= 0 && S[n] < pool, "slots: token ", n, " writes slot ", S[n], " of a pool of ", pool);
  if (k_cache.scalar_type() == torch::kFloat32)
    rope_store_impl<float>(qk, v, cos, sin, k_cache, v_cache, slots);
  else
    rope_store_impl<at::BFloat16>(qk, v, cos, sin, k_cache, v_cache, slots);
}

struct Work {  // one token of a chunk, for one kv head
  int32_t chunk, token, head;
  int64_t until;  // the cost of the work up to this one's end: keys attended, plus KEYS_A_TOKEN a token
};

constexpr int64_t KEYS_A_TOKEN = 8;  // about what a token's softmax and set-up cost, in keys

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 is fp32's high half
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// A sequence's keys (or values) of one kv head in the paged cache: row(l) is position l's D values.
template <typename T>
struct Rows {
  const T* cache;
  const int32_t* table;
  int64_t bs, stride, head;  // stride: kv_heads * D, the distance between two slots
  const T* row(int64_t l) const { return cache + ((int64_t)table[l / bs] * bs + l % bs) * stride + head; }
  void rows8(int64_t l, const T* out[8]) const {  // rows l .. l + 7, one division
    for (int64_t j = 0, b = l / bs, o = l % bs; j < 8; ++j) {
      out[j] = cache + ((int64_t)table[b] * bs + o) * stride + head;
      if (++o == bs) o = 0, ++b;
    }
  }
};

// The scores of keys k[0..3] for H query heads at q (head h's row at q + h D), times the scale, to sc[h * visible]:
// each key's and head's products summed lane by lane over the row's blocks of eight (fma), then the eight lanes as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). Every head's score of a key is computed the same way whatever
// H is and wherever the key stands among the four.
template <int H, typename T>
inline void scores4(const float* q, const T* const k[4], int64_t D, __m128 scale, float* sc, int64_t visible) {
  __m256 acc[H][4];
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 qv[H];
    for (int h = 0; h < H; ++h) qv[h] = _mm256_loadu_ps(q + h * D + c);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8(k[j] + c);
      for (int h = 0; h < H; ++h) acc[h][j] = _mm256_fmadd_ps(qv[h], kv, acc[h][j]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3]));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    _mm_storeu_ps(sc + h * visible, _mm_mul_ps(s, scale));
  }
}

// out[h] += sum over keys o < n of p[h * visible + o] * v(o) for H heads and the 32 columns at v(0) (a key's at
// v(0) + o stride), each column's terms added in key order
template <int H, typename T>
inline void weigh32(const float* p, int64_t visible, const T* v, int64_t stride, int64_t n, float* out, int64_t D) {
  __m256 acc[H][4];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < 4; ++i) acc[h][i] = _mm256_loadu_ps(out + h * D + 8 * i);
  for (int64_t o = 0; o < n; ++o, v += stride) {
    __m256 pv[H];
    for (int h = 0; h < H; ++h) pv[h] = _mm256_set1_ps(p[h * visible + o]);
    for (int i = 0; i < 4; ++i) {
      const __m256 vv = load8(v + 8 * i);
      for (int h = 0; h < H; ++h) acc[h][i] = _mm256_fmadd_ps(pv[h], vv, acc[h][i]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + h * D + 8 * i, acc[h][i]);
}

// The largest of s[0 .. n - 1], n >= 1, as `top = std::max(top, s[i])` in order gives it; a NaN in s[0] makes it NaN
// and one elsewhere is passed over, as there. (A tie of +0 and -0 may come out as the other zero: x - top is the
// same either way, and so is every weight.)
inline float row_max(const float* s, int64_t n) {
  float top = s[0];
  int64_t i = 1;
  if (n >= 9) {
    __m256 m = _mm256_set1_ps(s[0]);
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(s + i), m);  // a NaN of s: m's lane kept
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float lane : lanes) top = std::max(top, lane);
  }
  for (; i < n; ++i) top = std::max(top, s[i]);
  return top;
}

// f(first, heads) over passes of up to three of G heads, split evenly (7: 3, 2, 2), heads as a compile-time count
template <typename F>
inline void head_passes(int64_t G, const F& f) {
  for (int64_t g = 0, passes = (G + 2) / 3, p = 0; p < passes; ++p) {
    const int64_t heads = (G - g) / (passes - p);
    if (heads == 3) f(g, std::integral_constant<int, 3>{});
    else if (heads == 2) f(g, std::integral_constant<int, 2>{});
    else f(g, std::integral_constant<int, 1>{});
    g += heads;
  }
}

// Attention of one token for the G query heads of one kv head, over its keys 0 .. visible - 1. A key's score is
// the same whatever the step holds (groups of eight keys start at multiples of eight of the token's own keys).
// NOTE: up to three heads a pass share each key and value as it is loaded, with twelve sums in flight (three heads
// of four keys, or of 32 columns). A head a pass with eight keys' sums (before 2026-12-07) gave the same floats
// and kept the FMA units half busy: each sum waits on its last fma, and the key or value came from memory per head.
template <typename T>
void attend(const float* q, const Rows<T>& K, const Rows<T>& V, int64_t visible, int64_t G, int64_t D, float scale,
            std::vector<float>& scores, float* out) {
  scores.resize(G * visible + G);  // the scores, then each head's 1 / sum of its weights (the thread's buffer)
  float* sc = scores.data();
  int64_t l = 0;
  if (D % 8 == 0) {
    const __m128 sv = _mm_set1_ps(scale);
    for (; l + 8 <= visible; l += 8) {
      const T* k[8];
      K.rows8(l, k);
      head_passes(G, [&](int64_t g, auto heads) {
        constexpr int H = decltype(heads)::value;
        scores4<H>(q + g * D, k, D, sv, sc + g * visible + l, visible);
        scores4<H>(q + g * D, k + 4, D, sv, sc + g * visible + l + 4, visible);
      });
    }
  }
  for (; l < visible; ++l) {
    const T* k = K.row(l);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(k[d]);
      sc[g * visible + l] = s * scale;
    }
  }
  float* inv = sc + G * visible;
  for (int64_t g = 0; g < G; ++g) {
    float* s = sc + g * visible;
    const float top = row_max(s, visible);
#pragma omp simd
    for (int64_t i = 0; i < visible; ++i) s[i] = exp_approx(s[i] - top);
    inv[g] = 0.f;
  }
  // NOTE: each head's weights summed in order, not in vector lanes (the same floats whatever the alignment of its
  // row); the heads side by side, so that the G sums' additions overlap instead of each waiting on the last
  for (int64_t i = 0; i < visible; ++i)
    for (int64_t g = 0; g < G; ++g) inv[g] += sc[g * visible + i];
  for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / inv[g];
  std::fill(out, out + G * D, 0.f);
  for (int64_t start = 0; start < visible; start += V.bs) {
    const int64_t n = std::min(V.bs, visible - start);
    const T* block = V.row(start);  // the block's first slot: its others follow at V.stride
    if (D % 32 == 0) {
      head_passes(G, [&](int64_t g, auto heads) {
        constexpr int H = decltype(heads)::value;
        for (int64_t c0 = 0; c0 < D; c0 += 32)
          weigh32<H>(sc + g * visible + start, visible, block + c0, V.stride, n, out + g * D + c0, D);
      });
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* p = sc + g * visible + start;
      float* og = out + g * D;
      for (int64_t o = 0; o < n; ++o) {
        const T* v = block + o * V.stride;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += p[o] * to_float(v[d]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* og = out + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) og[d] *= inv[g];
  }
}

template <typename T>
void paged_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const int32_t* starts, const int32_t* lens,
                          const torch::Tensor& block_tables, double scale, const std::vector<Work>& work) {
  const int64_t Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const float* Q = q.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const T *KC = k_cache.data_ptr<T>(), *VC = v_cache.data_ptr<T>();
  const int32_t* BT = block_tables.data_ptr<int32_t>();
  const int64_t W = block_tables.size(1);
  // NOTE: each thread takes an equal share of the keys, not of the tokens: a prompt's last tokens attend the most
  // keys, and with equal counts of tokens the first of two threads had a quarter of a prefill's keys, then waited
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), work.size());
  const int64_t total = work.empty() ? 0 : work.back().until;
  const auto part = [&](int64_t t) {  // the first item of thread t's share
    if (t == threads) return (int64_t)work.size();
    const int64_t from = total * t / threads;
    return (int64_t)(std::upper_bound(work.begin(), work.end(), from,
                                      [](int64_t c, const Work& w) { return c < w.until; }) - work.begin());
  };
  tokenrouter::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t i = part(t0), end = part(t1); i < end; ++i) {
      const Work& w = work[i];
      const int64_t n = starts[w.chunk + 1] - starts[w.chunk], row = starts[w.chunk] + w.token;
      const int64_t visible = lens[w.chunk] - n + w.token + 1;  // keys 0 .. the token's own position
      const int64_t head = w.head * G * D;  // the first of the kv head's query heads
      const Rows<T> keys{KC, BT + w.chunk * W, bs, Hkv * D, w.head * D};
      const Rows<T> values{VC, keys.table, bs, Hkv * D, w.head * D};
      attend<T>(Q + row * q.stride(0) + head, keys, values, visible, G, D, (float)scale, scores,
                O + row * Hq * D + head);
    }
  });
}

void paged_attention_(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& query_start_loc,
                      const torch::Tensor& seq_lens, const torch::Tensor& block_tables, double scale,
                      int64_t max_query_len) {
  check_heads(q, "q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat32,
              "out: contiguous float32, shaped as q");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), B = seq_lens.numel();
  check_cache(k_cache, "k_cache", Hkv, D);
  check_cache(v_cache, "v_cache", Hkv, D);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "k_cache, v_cache: one shape and dtype");
  TORCH_CHECK(Hq % Hkv == 0, "q: ", Hq, " heads do not share ", Hkv, " kv heads evenly");
  TORCH_CHECK(query_start_loc.numel() == B + 1 && query_start_loc.scalar_type() == torch::kInt32 &&
              seq_lens.scalar_type() == torch::kInt32 && query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "query_start_loc [B + 1], seq_lens [B]: contiguous int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.is_contiguous() &&
              block_tables.scalar_type() == torch::kInt32, "block_tables: a contiguous [B, W] int32 tensor");
  const int32_t *starts = query_start_loc.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[B] <= q.size(0), "query_start_loc: ", starts[B], " tokens, q holds ", q.size(0));
  std::vector<Work> work;
  for (int32_t c = 0; c < B; ++c) {
    const int32_t n = starts[c + 1] - starts[c];
    TORCH_CHECK(n >= 0 && n <= lens[c] && lens[c] <= block_tables.size(1) * k_cache.size(1),
                "chunk ", c, ": ", n, " tokens of a context of ", lens[c], " beyond its block table");
    if (n > max_query_len) continue;
    for (int64_t b = 0, used = (lens[c] + k_cache.size(1) - 1) / k_cache.size(1); b < used; ++b) {
      const int32_t block = block_tables.data_ptr<int32_t>()[c * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < k_cache.size(0), "block_tables: chunk ", c, " names block ", block,
                  " of a pool of ", k_cache.size(0));
    }
    for (int32_t t = 0; t < n; ++t)
      for (int32_t h = 0; h < Hkv; ++h)
        work.push_back({c, t, h, (work.empty() ? 0 : work.back().until) + lens[c] - n + t + 1 + KEYS_A_TOKEN});
  }
  if (k_cache.scalar_type() == torch::kFloat32)
    paged_attention_impl<float>(out, q, k_cache, v_cache, starts, lens, block_tables, scale, work);
  else
    paged_attention_impl<at::BFloat16>(out, q, k_cache, v_cache, starts, lens, block_tables, scale, work);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "x [M, K] float32 -> x * rsqrt(mean(x^2) + eps) * w");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta)) in one pass");
  m.def("silu_mul", &silu_mul, "gate_up [M, 2I] -> silu(gate) * up [M, I]");
  m.def("rope_store_", &rope_store_, "rotate qk in place and write k, v to the cache slots");
  m.def("paged_attention_", &paged_attention_, "causal attention over the paged cache, chunks up to max_query_len");
}
