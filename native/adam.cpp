#include "adam.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "cpu.h"
#include "elements.h"

// The arithmetic below is written operation by operation in the order torch's single-tensor
// Adam performs it (mul_, lerp_, mul_ + addcmul_, sqrt / bias correction + eps, addcdiv_), with
// fused multiply-adds exactly where torch's own vector kernels use one (lerp, addcmul, add with
// alpha) and nowhere else. So the results agree with torch.optim.Adam / AdamW to the last bit or within one
// rounding, and never drift from it step after step.
#pragma GCC optimize("fp-contract=off")

namespace infinity {
namespace {

// The per-call scalars, as float, as torch hands them to its element-wise kernels.
struct Scalars {
  float decay;        // 1 - lr * weight_decay (AdamW), 1 when there is none
  float l2;           // weight_decay for Adam's L2 term, 0 for AdamW
  float lerp_weight;  // 1 - beta1
  bool lerp_small;    // |lerp_weight| < 0.5: torch's lerp takes the form that starts from exp_avg
  float beta2;
  float one_minus_beta2;
  float bias2_sqrt;   // sqrt(1 - beta2^step), divided into sqrt(exp_avg_sq)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float grad_scale;
};

Scalars scalars_of(const AdamHyper& h) {
  Scalars s;
  s.decay = (h.decoupled && h.weight_decay != 0.0) ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.l2 = (!h.decoupled) ? static_cast<float>(h.weight_decay) : 0.0f;
  s.lerp_weight = static_cast<float>(1.0 - h.beta1);
  s.lerp_small = std::fabs(s.lerp_weight) < 0.5f;
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  const double step = static_cast<double>(h.step);
  const double bias1 = 1.0 - std::pow(h.beta1, step);
  const double bias2 = 1.0 - std::pow(h.beta2, step);
  s.bias2_sqrt = static_cast<float>(std::pow(bias2, 0.5));
  s.eps = static_cast<float>(h.eps);
  s.neg_step_size = static_cast<float>(-(h.lr / bias1));
  s.grad_scale = static_cast<float>(h.grad_scale);
  return s;
}

void step_scalar(const AdamBuffers& b, const Scalars& s, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float g = load_element(b.grad, b.grad_type, i) * s.grad_scale;
    float p = b.param[i];
    if (s.l2 != 0.0f) g = std::fma(p, s.l2, g);
    if (s.decay != 1.0f) p = p * s.decay;
    const float m0 = b.exp_avg[i];
    const float m = s.lerp_small ? std::fma(s.lerp_weight, g - m0, m0)
                                 : std::fma(s.lerp_weight - 1.0f, g - m0, g);
    float v = b.exp_avg_sq[i] * s.beta2;
    v = std::fma(s.one_minus_beta2 * g, g, v);
    const float denom = std::sqrt(v) / s.bias2_sqrt + s.eps;
    p = p + (s.neg_step_size * m) / denom;
    b.param[i] = p;
    b.exp_avg[i] = m;
    b.exp_avg_sq[i] = v;
    if (b.low != nullptr) store_element(b.low, b.low_type, i, p);
  }
}

// --- AVX-512: 16 elements at a time -------------------------------------------------------

__attribute__((target("avx512f,avx512bw,avx512vl"))) void step_avx512(const AdamBuffers& b, const Scalars& s,
                                                                       size_t begin, size_t end) {
  const __m512 grad_scale = _mm512_set1_ps(s.grad_scale);
  const __m512 l2 = _mm512_set1_ps(s.l2);
  const __m512 decay = _mm512_set1_ps(s.decay);
  const __m512 coeff = _mm512_set1_ps(s.lerp_small ? s.lerp_weight : s.lerp_weight - 1.0f);
  const __m512 beta2 = _mm512_set1_ps(s.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 bias2_sqrt = _mm512_set1_ps(s.bias2_sqrt);
  const __m512 eps = _mm512_set1_ps(s.eps);
  const __m512 neg_step = _mm512_set1_ps(s.neg_step_size);
  const bool use_l2 = s.l2 != 0.0f, use_decay = s.decay != 1.0f, small = s.lerp_small;
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 g = _mm512_mul_ps(load_elements16(b.grad, b.grad_type, i), grad_scale);
    __m512 p = _mm512_loadu_ps(b.param + i);
    if (use_l2) g = _mm512_fmadd_ps(p, l2, g);
    if (use_decay) p = _mm512_mul_ps(p, decay);
    const __m512 m0 = _mm512_loadu_ps(b.exp_avg + i);
    const __m512 m = _mm512_fmadd_ps(coeff, _mm512_sub_ps(g, m0), small ? m0 : g);
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(b.exp_avg_sq + i), beta2);
    v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, v);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bias2_sqrt), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step, m), denom));
    _mm512_storeu_ps(b.param + i, p);
    _mm512_storeu_ps(b.exp_avg + i, m);
    _mm512_storeu_ps(b.exp_avg_sq + i, v);
    if (b.low != nullptr) store_elements16(b.low, b.low_type, i, p);
  }
  step_scalar(b, s, i, end);
}

// --- AVX2 (+FMA, F16C): 8 elements at a time ----------------------------------------------

__attribute__((target("avx2,fma,f16c"))) void step_avx2(const AdamBuffers& b, const Scalars& s, size_t begin,
                                                        size_t end) {
  const __m256 grad_scale = _mm256_set1_ps(s.grad_scale);
  const __m256 l2 = _mm256_set1_ps(s.l2);
  const __m256 decay = _mm256_set1_ps(s.decay);
  const __m256 coeff = _mm256_set1_ps(s.lerp_small ? s.lerp_weight : s.lerp_weight - 1.0f);
  const __m256 beta2 = _mm256_set1_ps(s.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 bias2_sqrt = _mm256_set1_ps(s.bias2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps);
  const __m256 neg_step = _mm256_set1_ps(s.neg_step_size);
  const bool use_l2 = s.l2 != 0.0f, use_decay = s.decay != 1.0f, small = s.lerp_small;
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_mul_ps(load_elements8(b.grad, b.grad_type, i), grad_scale);
    __m256 p = _mm256_loadu_ps(b.param + i);
    if (use_l2) g = _mm256_fmadd_ps(p, l2, g);
    if (use_decay) p = _mm256_mul_ps(p, decay);
    const __m256 m0 = _mm256_loadu_ps(b.exp_avg + i);
    const __m256 m = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m0), small ? m0 : g);
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(b.exp_avg_sq + i), beta2);
    v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, v);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bias2_sqrt), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
    _mm256_storeu_ps(b.param + i, p);
    _mm256_storeu_ps(b.exp_avg + i, m);
    _mm256_storeu_ps(b.exp_avg_sq + i, v);
    if (b.low != nullptr) store_elements8(b.low, b.low_type, i, p);
  }
  step_scalar(b, s, i, end);
}

using StepFn = void (*)(const AdamBuffers&, const Scalars&, size_t, size_t);


const StepFn kStep = by_simd_level<StepFn>(step_avx512, step_avx2, step_scalar);

StepFn step_named(const std::string& name) {
  if (name == "auto") return kStep;
  if (name == "scalar") return step_scalar;
  const std::string level = simd_level();
  if (name == "avx512" && level == "avx512") return step_avx512;
  if (name == "avx2" && (level == "avx512" || level == "avx2") && has_f16c()) return step_avx2;
  return nullptr;
}

bool valid_type(ElementType t, bool allow_none) {
  switch (t) {
    case ElementType::kNone: return allow_none;
    case ElementType::kFloat32:
    case ElementType::kBFloat16:
    case ElementType::kFloat16: return true;
  }
  return false;
}

}  // namespace

const char* adam_check(const AdamBuffers& b, const AdamHyper& h) {
  if (b.param == nullptr || b.grad == nullptr || b.exp_avg == nullptr || b.exp_avg_sq == nullptr)
    return "param, grad, exp_avg and exp_avg_sq must all be given (non-zero addresses)";
  if (!valid_type(b.grad_type, false)) return "the gradient's type must be float32, bfloat16 or float16";
  if (!valid_type(b.low_type, true)) return "the low-precision copy's type must be none, float32, bfloat16 or float16";
  if ((b.low == nullptr) != (b.low_type == ElementType::kNone))
    return "give the low-precision copy's address and type together, or neither";
  if (h.step < 1) return "step counts from 1: pass the number of the step being taken";
  if (!(h.lr >= 0.0) || !std::isfinite(h.lr)) return "lr must be a finite number >= 0";
  if (!(h.beta1 >= 0.0 && h.beta1 < 1.0) || !(h.beta2 >= 0.0 && h.beta2 < 1.0))
    return "betas must each be in [0, 1)";
  if (!(h.eps >= 0.0) || !std::isfinite(h.eps)) return "eps must be a finite number >= 0";
  if (!(h.weight_decay >= 0.0) || !std::isfinite(h.weight_decay)) return "weight_decay must be a finite number >= 0";
  if (!std::isfinite(h.grad_scale)) return "grad_scale must be finite";
  return "";
}

void adam_step_range(const AdamBuffers& buffers, const AdamHyper& hyper, size_t begin, size_t end) {
  if (begin >= end) return;
  kStep(buffers, scalars_of(hyper), begin, end);
}

bool adam_step_range_with(const char* implementation, const AdamBuffers& buffers, const AdamHyper& hyper,
                          size_t begin, size_t end) {
  const StepFn fn = step_named(implementation);
  if (fn == nullptr) return false;
  if (begin < end) fn(buffers, scalars_of(hyper), begin, end);
  return true;
}

namespace {

// The bound an Adam kernel is measured against: the same bytes moved (read param, grad and both
// moments; write param, both moments and the low copy) with one add, so memory alone limits it.
// The moments are written back as they were read: a benchmark can run it between real steps
// on the same state without turning that state into garbage.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void bound_avx512(const AdamBuffers& b, size_t begin,
                                                                        size_t end) {
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 g = load_elements16(b.grad, b.grad_type, i);
    const __m512 p = _mm512_add_ps(_mm512_loadu_ps(b.param + i), g);
    _mm512_storeu_ps(b.param + i, p);
    // m + 0 * g: the value read (for a finite gradient), stored by an arithmetic result the
    // compiler cannot prove equal to what it loaded, so the store is not dropped.
    const __m512 none = _mm512_mul_ps(g, _mm512_setzero_ps());
    _mm512_storeu_ps(b.exp_avg + i, _mm512_add_ps(_mm512_loadu_ps(b.exp_avg + i), none));
    _mm512_storeu_ps(b.exp_avg_sq + i, _mm512_add_ps(_mm512_loadu_ps(b.exp_avg_sq + i), none));
    if (b.low != nullptr) store_elements16(b.low, b.low_type, i, p);
  }
  for (; i < end; ++i) {
    const float g = load_element(b.grad, b.grad_type, i);
    b.param[i] += g;
    b.exp_avg[i] += 0.0f * g;
    b.exp_avg_sq[i] += 0.0f * g;
    if (b.low != nullptr) store_element(b.low, b.low_type, i, b.param[i]);
  }
}

void bound_scalar(const AdamBuffers& b, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float g = load_element(b.grad, b.grad_type, i);
    b.param[i] += g;
    b.exp_avg[i] += 0.0f * g;
    b.exp_avg_sq[i] += 0.0f * g;
    if (b.low != nullptr) store_element(b.low, b.low_type, i, b.param[i]);
  }
}

}  // namespace

void adam_bound_range(const AdamBuffers& buffers, size_t begin, size_t end) {
  if (begin >= end) return;
  if (kStep == step_avx512)
    bound_avx512(buffers, begin, end);
  else
    bound_scalar(buffers, begin, end);
}

namespace {

GradStats stats_scalar(const void* grad, ElementType type, size_t begin, size_t end) {
  GradStats out;
  for (size_t i = begin; i < end; ++i) {
    const float g = load_element(grad, type, i);
    if (!std::isfinite(g)) out.nonfinite = true;
    out.sum_of_squares += static_cast<double>(g) * static_cast<double>(g);
  }
  return out;
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) GradStats stats_avx512(const void* grad, ElementType type,
                                                                            size_t begin, size_t end) {
  // Squares summed in double (two accumulators of 8), so a billion-element norm keeps its digits.
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  __mmask16 bad = 0;
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 g = load_elements16(grad, type, i);
    // inf and NaN are the values whose exponent bits are all set.
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(g), exponent), exponent);
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
    lo = _mm512_add_pd(lo, _mm512_mul_pd(a, a));
    hi = _mm512_add_pd(hi, _mm512_mul_pd(b, b));
  }
  GradStats out = stats_scalar(grad, type, i, end);
  out.sum_of_squares += _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
  out.nonfinite = out.nonfinite || bad != 0;
  return out;
}

}  // namespace

GradStats grad_stats_range(const void* grad, ElementType type, size_t begin, size_t end) {
  if (begin >= end) return GradStats{};
  if (kStep == step_avx512) return stats_avx512(grad, type, begin, end);
  return stats_scalar(grad, type, begin, end);
}

const char* adam_implementation() {
  if (kStep == step_avx512) return "avx512";
  if (kStep == step_avx2) return "avx2";
  return "scalar";
}

}  // namespace infinity
