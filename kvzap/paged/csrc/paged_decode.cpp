// Fused paged attention for one decoded token per sequence (CPU), for kvzap's compact cache.
//
// The same computation as kvzap.paged.attention.paged_attention with q_len == 1, in one call: for every head
// (batch row, KV head) the query rows of its group read the blocks the head owns, with a softmax split over
// chunks of blocks (flash decoding) merged per head. The work is split over (head, chunk) tasks with
// at::parallel_for, so it uses torch's intra-op threads. Reads each kept pair once per step, writes nothing but
// the output, and replaces the ~14 tensor operations (and their dispatch) of the generic path.
//
// Quantized storage (kv_bits 8 or 4, kvzap.paged.quant): keys and values are uint8 codes (two 4-bit codes per
// byte, the even channel in the low nibble) with float16 (scale, min) per slot and group of channels; each block
// is dequantized into float buffers of the task as it is read (code * scale + min), then attended as float pairs.
//
// quantize_store writes appended pairs into a quantized pool (quantize and copy, in one call per pool tensor).
//
// Built on first use by kvzap.paged.kernels (torch.utils.cpp_extension.load_inline); the generic path serves
// every case this kernel does not take (multi-token steps, CUDA, no compiler).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Blocks per task: a chunk is read by one thread (256 slots at the default block size).
constexpr int64_t kChunkBlocks = 4;

// exp(x) for x <= 0 (a logit minus its running max), vectorizable: Cody-Waite range reduction and a degree-6
// polynomial (relative error ~2e-7, as expf); x below -87 gives 0.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23 trick)
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// Dot product with eight independent partial sums (vectorized without reassociating a single sum).
template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t d) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int j = 0; j < 8; ++j) part[j] += q[i + j] * static_cast<float>(k[i + j]);
  }
  float acc = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVZAP_AVX2 1

// exp_nonpositive on 8 lanes (the same range reduction and polynomial).
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(r, r), p, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// The eight sums of v0 .. v7, as one vector.
inline __m256 sum8x8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// lg[g * bs + s] = q_g . k_s + sb[s] for a block (float keys; d a multiple of 8): eight slots at a time.
inline void block_logits_f32(const float* q, int64_t groups, int64_t d, const float* kb, int64_t bs, const float* sb,
                             float* lg) {
  int64_t s0 = 0;
  for (; s0 + 8 <= bs; s0 += 8) {
    const float* k0 = kb + s0 * d;
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = q + g * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qi = _mm256_loadu_ps(qg + i);
        a0 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + d + i), a1);
        a2 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + 2 * d + i), a2);
        a3 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + 3 * d + i), a3);
        a4 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + 4 * d + i), a4);
        a5 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + 5 * d + i), a5);
        a6 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + 6 * d + i), a6);
        a7 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + 7 * d + i), a7);
      }
      const __m256 sums = _mm256_add_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_loadu_ps(sb + s0));
      _mm256_storeu_ps(lg + g * bs + s0, sums);
    }
  }
  for (; s0 < bs; ++s0) {
    for (int64_t g = 0; g < groups; ++g) lg[g * bs + s0] = dot(q + g * d, kb + s0 * d, d) + sb[s0];
  }
}

// One query row's online-softmax update with a block (float values; dv a multiple of 8): lg (bs,) logits in,
// overwritten with the weights.
inline void block_update_f32(float* lg, int64_t bs, const float* vb, int64_t dv, float& mx, float& sm, float* acc) {
  const __m256 ninf8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m8 = ninf8;
  int64_t s = 0;
  for (; s + 8 <= bs; s += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(lg + s));
  float m = mx;
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, m8);
  for (int j = 0; j < 8; ++j) m = std::max(m, tmp[j]);
  for (int64_t r = s; r < bs; ++r) m = std::max(m, lg[r]);
  if (m == -std::numeric_limits<float>::infinity()) return;  // nothing live in this block for this row
  const float rescale = mx == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(mx - m);
  if (rescale != 1.f) {
    sm *= rescale;
    for (int64_t i = 0; i < dv; ++i) acc[i] *= rescale;
  }
  mx = m;
  const __m256 mm = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (s = 0; s + 8 <= bs; s += 8) {
    const __m256 l = _mm256_loadu_ps(lg + s);
    const __m256 dead = _mm256_cmp_ps(l, ninf8, _CMP_EQ_OQ);
    const __m256 w = _mm256_andnot_ps(dead, exp8_nonpositive(_mm256_sub_ps(l, mm)));
    _mm256_storeu_ps(lg + s, w);
    total = _mm256_add_ps(total, w);
  }
  _mm256_store_ps(tmp, total);
  float block_sum = ((tmp[0] + tmp[1]) + (tmp[2] + tmp[3])) + ((tmp[4] + tmp[5]) + (tmp[6] + tmp[7]));
  for (; s < bs; ++s) {
    const float w = lg[s] == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(lg[s] - m);
    lg[s] = w;
    block_sum += w;
  }
  sm += block_sum;
  // acc += sum_s w_s v_s, 64 output columns at a time kept in registers.
  for (int64_t i0 = 0; i0 < dv; i0 += 64) {
    const int64_t width = std::min<int64_t>(64, dv - i0);
    if (width == 64) {
      __m256 c0 = _mm256_loadu_ps(acc + i0), c1 = _mm256_loadu_ps(acc + i0 + 8), c2 = _mm256_loadu_ps(acc + i0 + 16),
             c3 = _mm256_loadu_ps(acc + i0 + 24), c4 = _mm256_loadu_ps(acc + i0 + 32),
             c5 = _mm256_loadu_ps(acc + i0 + 40), c6 = _mm256_loadu_ps(acc + i0 + 48),
             c7 = _mm256_loadu_ps(acc + i0 + 56);
      for (int64_t r = 0; r < bs; ++r) {
        if (lg[r] == 0.f) continue;
        const __m256 w = _mm256_set1_ps(lg[r]);
        const float* v = vb + r * dv + i0;
        c0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), c0);
        c1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), c1);
        c2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), c2);
        c3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), c3);
        c4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), c4);
        c5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), c5);
        c6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), c6);
        c7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), c7);
      }
      _mm256_storeu_ps(acc + i0, c0);
      _mm256_storeu_ps(acc + i0 + 8, c1);
      _mm256_storeu_ps(acc + i0 + 16, c2);
      _mm256_storeu_ps(acc + i0 + 24, c3);
      _mm256_storeu_ps(acc + i0 + 32, c4);
      _mm256_storeu_ps(acc + i0 + 40, c5);
      _mm256_storeu_ps(acc + i0 + 48, c6);
      _mm256_storeu_ps(acc + i0 + 56, c7);
    } else {
      for (int64_t r = 0; r < bs; ++r) {
        if (lg[r] == 0.f) continue;
        const __m256 w = _mm256_set1_ps(lg[r]);
        const float* v = vb + r * dv + i0;
        for (int64_t i = 0; i < width; i += 8)
          _mm256_storeu_ps(acc + i0 + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i0 + i)));
      }
    }
  }
}
#endif

// One block of a head for the group's query rows: logits (with the slots' additive bias sb), then the online
// softmax update of each row's running max mx, sum sm and weighted values acc.
template <typename kv_t>
inline void block_step(const float* q, int64_t groups, int64_t d, int64_t dv, int64_t bs, const kv_t* kb,
                       const kv_t* vb, const float* sb, float* logits, float* mx, float* sm, float* acc) {
  const float ninf = -std::numeric_limits<float>::infinity();
#ifdef KVZAP_AVX2
  if constexpr (std::is_same_v<kv_t, float>) {
    if (d % 8 == 0 && dv % 8 == 0) {
      block_logits_f32(q, groups, d, kb, bs, sb, logits);
      for (int64_t g = 0; g < groups; ++g) block_update_f32(logits + g * bs, bs, vb, dv, mx[g], sm[g], acc + g * dv);
      return;
    }
  }
#endif
  for (int64_t s = 0; s < bs; ++s) {
    const kv_t* ks = kb + s * d;
    for (int64_t g = 0; g < groups; ++g) logits[g * bs + s] = sb[s] == ninf ? ninf : dot(q + g * d, ks, d) + sb[s];
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* lg = logits + g * bs;
    float block_max = ninf;
    for (int64_t s = 0; s < bs; ++s) block_max = std::max(block_max, lg[s]);
    if (block_max == ninf) continue;
    const float new_max = std::max(mx[g], block_max);
    const float rescale = mx[g] == ninf ? 0.f : exp_nonpositive(mx[g] - new_max);
    float* a = acc + g * dv;
    if (rescale != 1.f) {
      sm[g] *= rescale;
      for (int64_t i = 0; i < dv; ++i) a[i] *= rescale;
    }
    mx[g] = new_max;
    float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
    for (int64_t s = 0; s < bs; ++s) {
      const float w = lg[s] == ninf ? 0.f : exp_nonpositive(lg[s] - new_max);
      lg[s] = w;
      block_sum += w;
    }
    sm[g] += block_sum;
    for (int64_t s = 0; s < bs; ++s) {
      const float w = lg[s];
      if (w == 0.f) continue;
      const kv_t* vs = vb + s * dv;
#pragma omp simd
      for (int64_t i = 0; i < dv; ++i) a[i] += w * static_cast<float>(vs[i]);
    }
  }
}

// A block's quantized vectors (bs slots of d channels, ng groups) into floats: code * scale + min per group.
inline void dequant_block(const uint8_t* codes, const at::Half* scales, int64_t bs, int64_t d, int64_t ng,
                          int64_t bits, float* out) {
  const int64_t group = d / ng, width = bits == 8 ? d : d / 2;
  for (int64_t s = 0; s < bs; ++s) {
    const uint8_t* c = codes + s * width;
    const at::Half* sc = scales + s * ng * 2;
    float* o = out + s * d;
    for (int64_t g = 0; g < ng; ++g) {
      const float scale = static_cast<float>(sc[2 * g]), mn = static_cast<float>(sc[2 * g + 1]);
      float* og = o + g * group;
      if (bits == 8) {
        const uint8_t* cg = c + g * group;
#pragma omp simd
        for (int64_t i = 0; i < group; ++i) og[i] = static_cast<float>(cg[i]) * scale + mn;
      } else {
        const uint8_t* cg = c + g * group / 2;
#pragma omp simd
        for (int64_t i = 0; i < group / 2; ++i) {
          og[2 * i] = static_cast<float>(cg[i] & 15) * scale + mn;
          og[2 * i + 1] = static_cast<float>(cg[i] >> 4) * scale + mn;
        }
      }
    }
  }
}

template <typename scalar_t>
void decode_kernel(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                   const at::Tensor& bias, const at::Tensor& owner, const at::Tensor& positions,
                   const c10::optional<at::Tensor>& mask, int64_t num_used, int64_t kv_heads, double scale,
                   const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales,
                   int64_t bits, at::Tensor& out) {
  const int64_t bsz = query.size(0), n_q_heads = query.size(1), d = query.size(3);
  const int64_t groups = n_q_heads / kv_heads, nh = bsz * kv_heads;
  const bool quant = bits != 0;
  const int64_t bs = keys.size(1), dv = out.size(3);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = quant ? nullptr : keys.data_ptr<scalar_t>();
  const scalar_t* v_ptr = quant ? nullptr : values.data_ptr<scalar_t>();
  const uint8_t* kc_ptr = quant ? keys.data_ptr<uint8_t>() : nullptr;
  const uint8_t* vc_ptr = quant ? values.data_ptr<uint8_t>() : nullptr;
  const at::Half* ks_ptr = quant ? key_scales->data_ptr<at::Half>() : nullptr;
  const at::Half* vs_ptr = quant ? value_scales->data_ptr<at::Half>() : nullptr;
  const int64_t kcw = keys.size(2), vcw = values.size(2);
  const int64_t kng = quant ? key_scales->size(2) : 0, vng = quant ? value_scales->size(2) : 0;
  const scalar_t* b_ptr = bias.data_ptr<scalar_t>();
  const int64_t* o_ptr = owner.data_ptr<int64_t>();
  const int32_t* p_ptr = positions.data_ptr<int32_t>();
  const bool* m_ptr = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t m_rows = mask.has_value() ? mask->size(0) : 0, seen = mask.has_value() ? mask->size(1) : 0;
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  // The blocks of each head, in pool order (a block owned by no head, owner >= nh, is skipped).
  std::vector<std::vector<int64_t>> head_blocks(nh);
  for (int64_t blk = 0; blk < num_used; ++blk) {
    const int64_t h = o_ptr[blk];
    if (h >= 0 && h < nh) head_blocks[h].push_back(blk);
  }
  // Tasks: (head, first block index in its list).
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t n = static_cast<int64_t>(head_blocks[h].size());
    for (int64_t c = 0; c < n; c += kChunkBlocks) tasks.emplace_back(h, c);
    if (n == 0) tasks.emplace_back(h, 0);  // a head with no pair: its rows get NaN, as sdpa gives
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  // Per task and query row of the group: running max, sum of weights, weighted values.
  std::vector<float> t_max(n_tasks * groups), t_sum(n_tasks * groups), t_acc(n_tasks * groups * dv);
  const float ninf = -std::numeric_limits<float>::infinity();

  // A few blocks are read faster by one thread than woken threads would share them.
  const int64_t grain = num_used < 16 ? n_tasks : 1;
  at::parallel_for(0, n_tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q(groups * d), logits(groups * bs), sb(bs);
    std::vector<float> kf(quant ? bs * d : 0), vf(quant ? bs * dv : 0);  // a quantized block, dequantized
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = tasks[t].first, c0 = tasks[t].second;
      const int64_t b = h / kv_heads;
      const auto& blocks = head_blocks[h];
      const int64_t c1 = std::min<int64_t>(c0 + kChunkBlocks, static_cast<int64_t>(blocks.size()));
      // The group's query rows of this head, scaled, in float.
      for (int64_t g = 0; g < groups; ++g) {
        const scalar_t* src = q_ptr + ((h * groups + g) * d);  // (B, Hq, 1, d): head h's rows are consecutive
        for (int64_t i = 0; i < d; ++i) q[g * d + i] = static_cast<float>(src[i]) * static_cast<float>(scale);
      }
      float* mx = t_max.data() + t * groups;
      float* sm = t_sum.data() + t * groups;
      float* acc = t_acc.data() + t * groups * dv;
      std::fill(mx, mx + groups, ninf);
      std::fill(sm, sm + groups, 0.f);
      std::fill(acc, acc + groups * dv, 0.f);
      const bool* mrow = m_ptr ? m_ptr + std::min(b, m_rows - 1) * seen : nullptr;
      for (int64_t ci = c0; ci < c1; ++ci) {
        const int64_t blk = blocks[ci];
        const scalar_t* bb = b_ptr + blk * bs;
        const int32_t* pb = p_ptr + blk * bs;
        // The slots' additive bias (0 live, -inf free or hidden by the mask).
        bool any_live = false;
        for (int64_t s = 0; s < bs; ++s) {
          float bias_s = static_cast<float>(bb[s]);
          if (mrow) {
            const int64_t p = std::min<int64_t>(std::max<int64_t>(pb[s], 0), seen - 1);
            if (!mrow[p]) bias_s = ninf;
          }
          sb[s] = bias_s;
          any_live |= bias_s != ninf;
        }
        if (!any_live) continue;
        if (quant) {
          dequant_block(kc_ptr + blk * bs * kcw, ks_ptr + blk * bs * kng * 2, bs, d, kng, bits, kf.data());
          dequant_block(vc_ptr + blk * bs * vcw, vs_ptr + blk * bs * vng * 2, bs, dv, vng, bits, vf.data());
          block_step<float>(q.data(), groups, d, dv, bs, kf.data(), vf.data(), sb.data(), logits.data(), mx, sm, acc);
        } else {
          block_step<scalar_t>(q.data(), groups, d, dv, bs, k_ptr + blk * bs * d, v_ptr + blk * bs * dv, sb.data(),
                               logits.data(), mx, sm, acc);
        }
      }
    }
  });

  // Merge each head's tasks (consecutive in `tasks`) and write the output rows.
  int64_t t = 0;
  std::vector<float> row(dv);
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t t0 = t;
    while (t < n_tasks && tasks[t].first == h) ++t;
    for (int64_t g = 0; g < groups; ++g) {
      float m = ninf;
      for (int64_t u = t0; u < t; ++u) m = std::max(m, t_max[u * groups + g]);
      float total = 0.f;
      std::fill(row.begin(), row.end(), 0.f);
      if (m != ninf) {
        for (int64_t u = t0; u < t; ++u) {
          const float mu = t_max[u * groups + g];
          if (mu == ninf) continue;
          const float f = std::exp(mu - m);
          total += f * t_sum[u * groups + g];
          const float* a = t_acc.data() + (u * groups + g) * dv;
          for (int64_t i = 0; i < dv; ++i) row[i] += f * a[i];
        }
      }
      scalar_t* dst = out_ptr + (h * groups + g) * dv;  // out (B, Hq, 1, dv)
      for (int64_t i = 0; i < dv; ++i) dst[i] = static_cast<scalar_t>(row[i] / total);  // 0/0: NaN, as sdpa
    }
  }
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& bias, const at::Tensor& owner, const at::Tensor& positions,
                        const c10::optional<at::Tensor>& mask, int64_t num_used, int64_t kv_heads, double scale,
                        const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales,
                        int64_t bits) {
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "paged_decode: query must be (B, Hq, 1, d)");
  TORCH_CHECK(query.is_contiguous() && keys.is_contiguous() && values.is_contiguous() && bias.is_contiguous() &&
                  owner.is_contiguous() && positions.is_contiguous(),
              "paged_decode: tensors must be contiguous");
  TORCH_CHECK(bias.scalar_type() == query.scalar_type(), "paged_decode: query and bias must share a dtype");
  const int64_t d = query.size(3);
  int64_t dv = values.size(2);
  if (bits == 0) {
    TORCH_CHECK(!key_scales.has_value() && !value_scales.has_value(), "paged_decode: scales given without bits");
    TORCH_CHECK(keys.scalar_type() == query.scalar_type() && values.scalar_type() == query.scalar_type(),
                "paged_decode: query, keys, values and bias must share a dtype");
    TORCH_CHECK(keys.size(2) == d, "paged_decode: keys and query head sizes differ");
  } else {
    TORCH_CHECK(bits == 8 || bits == 4, "paged_decode: bits must be 0 (float pairs), 8 or 4");
    TORCH_CHECK(key_scales.has_value() && value_scales.has_value(), "paged_decode: quantized pairs need their scales");
    TORCH_CHECK(keys.scalar_type() == at::kByte && values.scalar_type() == at::kByte,
                "paged_decode: quantized keys and values must be uint8 codes");
    if (bits == 4) dv *= 2;
    TORCH_CHECK(keys.size(2) == (bits == 8 ? d : d / 2) && (bits == 8 || d % 2 == 0),
                "paged_decode: the keys' codes do not match the query's head size");
    for (const auto* sc : {&*key_scales, &*value_scales}) {
      TORCH_CHECK(sc->scalar_type() == at::kHalf && sc->dim() == 4 && sc->size(3) == 2 && sc->is_contiguous() &&
                      sc->size(0) == keys.size(0) && sc->size(1) == keys.size(1),
                  "paged_decode: scales must be contiguous float16 (num_blocks, block_size, groups, 2)");
    }
    TORCH_CHECK(d % key_scales->size(2) == 0 && dv % value_scales->size(2) == 0,
                "paged_decode: groups must divide the head sizes");
    TORCH_CHECK(bits == 8 || ((d / key_scales->size(2)) % 2 == 0 && (dv / value_scales->size(2)) % 2 == 0),
                "paged_decode: 4-bit groups must hold an even number of channels");
  }
  TORCH_CHECK(owner.scalar_type() == at::kLong && positions.scalar_type() == at::kInt,
              "paged_decode: owner must be int64 and positions int32");
  TORCH_CHECK(kv_heads > 0 && query.size(1) % kv_heads == 0, "paged_decode: query heads must be a multiple of kv_heads");
  TORCH_CHECK(num_used >= 0 && num_used <= keys.size(0), "paged_decode: num_used out of range");
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->scalar_type() == at::kBool && mask->is_contiguous(),
                "paged_decode: mask must be a contiguous bool (B or 1, seen) tensor");
  }
  at::Tensor out = at::empty({query.size(0), query.size(1), 1, dv}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(query, keys, values, bias, owner, positions, mask, num_used, kv_heads, scale, key_scales,
                            value_scales, bits, out);
  });
  return out;
}

// Quantize pairs x (N, d) into flat slots of a quantized pool, as kvzap.paged.quant.quantize and then a copy:
// per slot and group of `group` channels, min lo and scale (max - lo) / levels rounded to float16, codes
// round((x - lo) / scale) (ties to even, as torch.round) clamped to [0, levels]; 4-bit codes two to a byte, the
// even channel in the low nibble. codes (num_blocks, bs, width) uint8 and scales (num_blocks, bs, d / group, 2)
// float16 are written at slots[n] (flat slot indices). Replaces the ~14 tensor operations per pool tensor of the
// Python path on every decoding step's append.
template <typename scalar_t>
void quantize_rows(const at::Tensor& x, const at::Tensor& slots, int64_t bits, int64_t group, at::Tensor& codes,
                   at::Tensor& scales) {
  const int64_t n = x.size(0), d = x.size(1), ng = d / group, width = bits == 8 ? d : d / 2;
  const float levels = static_cast<float>((1 << bits) - 1);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  uint8_t* c_ptr = codes.data_ptr<uint8_t>();
  at::Half* s_ptr = scales.data_ptr<at::Half>();
  std::vector<uint8_t> q(static_cast<size_t>(d));
  for (int64_t r = 0; r < n; ++r) {
    const scalar_t* row = x_ptr + r * d;
    const int64_t slot = slot_ptr[r];
    at::Half* sc = s_ptr + slot * ng * 2;
    for (int64_t g = 0; g < ng; ++g) {
      const scalar_t* xg = row + g * group;
      float lo = static_cast<float>(xg[0]), hi = lo;
      for (int64_t i = 1; i < group; ++i) {
        const float v = static_cast<float>(xg[i]);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
      }
      const at::Half lo_h(lo);
      const float lo32 = static_cast<float>(lo_h);
      const at::Half scale_h((hi - lo32) / levels);
      const float s32 = static_cast<float>(scale_h);
      const float inv = s32 > 0.f ? 1.f / s32 : 0.f;
      for (int64_t i = 0; i < group; ++i) {
        float c = std::nearbyint((static_cast<float>(xg[i]) - lo32) * inv);
        c = c < 0.f ? 0.f : (c > levels ? levels : c);
        q[g * group + i] = static_cast<uint8_t>(c);
      }
      sc[2 * g] = scale_h;
      sc[2 * g + 1] = lo_h;
    }
    uint8_t* dst = c_ptr + slot * width;
    if (bits == 8) {
      std::memcpy(dst, q.data(), static_cast<size_t>(d));
    } else {
      for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<uint8_t>(q[2 * i] | (q[2 * i + 1] << 4));
    }
  }
}

void quantize_store(at::Tensor codes, at::Tensor scales, const at::Tensor& slots, const at::Tensor& x, int64_t bits,
                    int64_t group) {
  TORCH_CHECK(bits == 8 || bits == 4, "quantize_store: bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 2 && slots.dim() == 1 && slots.size(0) == x.size(0),
              "quantize_store: x must be (N, d) and slots (N,)");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "quantize_store: slots must be int64");
  const int64_t d = x.size(1);
  TORCH_CHECK(group > 0 && d % group == 0 && (bits == 8 || group % 2 == 0),
              "quantize_store: the group must divide the head size (and be even at 4 bits)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous() &&
                  codes.size(2) == (bits == 8 ? d : d / 2),
              "quantize_store: codes must be contiguous uint8 (num_blocks, block_size, code width)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 4 && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == d / group && scales.size(3) == 2,
              "quantize_store: scales must be contiguous float16 (num_blocks, block_size, d / group, 2)");
  const at::Tensor xc = x.contiguous(), sc = slots.contiguous();
  const int64_t total = codes.size(0) * codes.size(1);
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < sc.size(0); ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < total, "quantize_store: slot ", sp[i], " out of range [0, ", total, ")");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "quantize_store", [&] {
    quantize_rows<scalar_t>(xc, sc, bits, group, codes, scales);
  });
}

}  // namespace

TORCH_LIBRARY(kvzap, m) {
  m.def("paged_decode(Tensor query, Tensor keys, Tensor values, Tensor bias, Tensor owner, Tensor positions, "
        "Tensor? mask, int num_used, int kv_heads, float scale, Tensor? key_scales=None, Tensor? value_scales=None, "
        "int bits=0) -> Tensor");
  m.def("quantize_store(Tensor(a!) codes, Tensor(b!) scales, Tensor slots, Tensor x, int bits, int group) -> ()");
}

TORCH_LIBRARY_IMPL(kvzap, CPU, m) {
  m.impl("paged_decode", TORCH_FN(paged_decode));
  m.impl("quantize_store", TORCH_FN(quantize_store));
}
