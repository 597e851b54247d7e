// The CPU optimizer kernels: one Adam / AdamW update over a range of a parameter's elements, in
// one pass over memory, and the gradient statistics (sum of squares, non-finite) that clipping
// and a loss scaler need. Ranges of one tensor may be updated by different threads at once.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity {

// The element types the kernels read (gradients) and write (the low-precision parameter copy).
enum class ElementType : int { kNone = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

// One step's hyperparameters. The scalars that torch.optim.Adam computes in double precision on
// the host (the bias corrections, the step size, the decay factor) are computed here the same
// way, once per call, so that the kernel's arithmetic matches torch's single-tensor Adam.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;          // the step being taken, counted from 1
  bool decoupled = true;     // AdamW (decay applied to the parameter) or Adam (L2 added to the gradient)
  double grad_scale = 1.0;   // every gradient is multiplied by this first (1/loss scale, clip factor)
};

struct AdamBuffers {
  float* param = nullptr;          // fp32 master weights, updated in place
  const void* grad = nullptr;      // the gradient, of grad_type
  ElementType grad_type = ElementType::kFloat32;
  float* exp_avg = nullptr;        // first moment, fp32, updated in place
  float* exp_avg_sq = nullptr;     // second moment, fp32, updated in place
  void* low = nullptr;             // the parameter as the model uses it (kNone: not written)
  ElementType low_type = ElementType::kNone;
};

// Validates the hyperparameters and buffers: returns "" when they are usable, else a sentence
// naming what is wrong (the binding turns it into ValueError).
const char* adam_check(const AdamBuffers& buffers, const AdamHyper& hyper);

// Updates elements [begin, end). The caller has checked the arguments with adam_check.
void adam_step_range(const AdamBuffers& buffers, const AdamHyper& hyper, size_t begin, size_t end);

// The same with a named path ("auto" | "scalar" | "avx2" | "avx512"), for tests and benchmarks
// that compare the paths; false (nothing done) when this CPU cannot run the one named.
bool adam_step_range_with(const char* implementation, const AdamBuffers& buffers, const AdamHyper& hyper,
                          size_t begin, size_t end);

// What bounds the kernel: the same memory traffic over [begin, end) with one add per buffer
// (benchmarks only: it destroys the optimizer state it is given).
void adam_bound_range(const AdamBuffers& buffers, size_t begin, size_t end);

struct GradStats {
  double sum_of_squares = 0.0;   // of the gradient's elements, accumulated in double
  bool nonfinite = false;        // any inf or NaN among them
};

// Statistics of elements [begin, end) of a gradient of the given type.
GradStats grad_stats_range(const void* grad, ElementType type, size_t begin, size_t end);

// "avx512" | "avx2" | "scalar": the path the kernels take on this CPU.
const char* adam_implementation();

}  // namespace infinity
