// The only file that knows about Python. Every call that can block (I/O
// waits, thread joins, checksums of large buffers, big allocations) runs
// with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "adam.h"
#include "aligned_buffer.h"
#include "copy.h"
#include "cpu.h"
#include "crc32c.h"
#include "dequantize.h"
#include "engine.h"
#include "errors.h"
#include "kaio.h"
#include "quant_linear.h"
#include "shared_memory.h"
#include "task_pool.h"
#include "tasks.h"
#include "uring.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

infinity::OpSpec parse_op(const py::handle& item, size_t i) {
  py::tuple t;
  try {
    t = py::reinterpret_borrow<py::object>(item).cast<py::tuple>();
  } catch (const py::cast_error&) {
    throw py::type_error("op " + std::to_string(i) + " is not a tuple; each op is (is_write, fd, buf_addr, "
                         "nbytes, file_offset, direct, crc_addr, crc_block_bytes[, staged])");
  }
  if (t.size() != 8 && t.size() != 9)
    throw py::value_error("op " + std::to_string(i) + " has " + std::to_string(t.size()) +
                          " fields, not 8 or 9; each op is (is_write, fd, buf_addr, nbytes, file_offset, direct, "
                          "crc_addr, crc_block_bytes[, staged])");
  try {
    infinity::OpSpec s;
    s.is_write = t[0].cast<bool>();
    s.fd = t[1].cast<int64_t>();
    s.buf_addr = t[2].cast<uint64_t>();
    s.nbytes = t[3].cast<int64_t>();
    s.file_offset = t[4].cast<int64_t>();
    s.direct = t[5].cast<bool>();
    s.crc_addr = t[6].cast<uint64_t>();
    s.crc_block_bytes = t[7].cast<int64_t>();
    if (t.size() == 9) s.staged = t[8].cast<bool>();
    return s;
  } catch (const py::cast_error&) {
    throw py::type_error("op " + std::to_string(i) + " has a field of the wrong type: " +
                         py::str(item).cast<std::string>() + " (expected bool, int, int, int, int, bool, int, int[, bool])");
  }
}


infinity::ElementType element_type(const std::string& name, const char* what) {
  if (name == "float32") return infinity::ElementType::kFloat32;
  if (name == "bfloat16") return infinity::ElementType::kBFloat16;
  if (name == "float16") return infinity::ElementType::kFloat16;
  if (name == "none") return infinity::ElementType::kNone;
  throw py::value_error(std::string(what) + " is " + name +
                        "; it must be float32, bfloat16 or float16 (or none for the low copy)");
}

size_t element_bytes(infinity::ElementType t) { return t == infinity::ElementType::kFloat32 ? 4 : 2; }


// The buffers and hyperparameters of one Adam call, checked: a ValueError names what is wrong.
struct AdamCall {
  infinity::AdamBuffers buffers;
  infinity::AdamHyper hyper;
  size_t numel = 0;
};

AdamCall adam_call(uint64_t param, uint64_t grad, const std::string& grad_dtype, uint64_t exp_avg,
                   uint64_t exp_avg_sq, uint64_t low, const std::string& low_dtype, int64_t numel, double lr,
                   double beta1, double beta2, double eps, double weight_decay, int64_t step, bool decoupled,
                   double grad_scale) {
  if (numel < 0) throw py::value_error("numel is " + std::to_string(numel) + "; it must be >= 0");
  AdamCall call;
  infinity::AdamBuffers& b = call.buffers;
  b.param = reinterpret_cast<float*>(param);
  b.grad = reinterpret_cast<const void*>(grad);
  b.grad_type = element_type(grad_dtype, "grad_dtype");
  b.exp_avg = reinterpret_cast<float*>(exp_avg);
  b.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq);
  b.low = reinterpret_cast<void*>(low);
  b.low_type = element_type(low_dtype, "low_dtype");
  infinity::AdamHyper& h = call.hyper;
  h.lr = lr; h.beta1 = beta1; h.beta2 = beta2; h.eps = eps; h.weight_decay = weight_decay;
  h.step = step; h.decoupled = decoupled; h.grad_scale = grad_scale;
  const std::string problem = infinity::adam_check(b, h);
  if (!problem.empty()) throw py::value_error(problem);
  // The buffers written or read must not overlap: a shared byte would be read after another
  // element's update wrote it.
  const size_t n = static_cast<size_t>(numel);
  const uint64_t starts[5] = {param, exp_avg, exp_avg_sq, grad, low};
  const uint64_t sizes[5] = {n * 4, n * 4, n * 4, n * element_bytes(b.grad_type),
                             low ? n * element_bytes(b.low_type) : 0};
  static const char* names[5] = {"param", "exp_avg", "exp_avg_sq", "grad", "low"};
  for (int i = 0; i < 5; ++i)
    for (int j = i + 1; j < 5; ++j)
      if (sizes[i] && sizes[j] && starts[i] < starts[j] + sizes[j] && starts[j] < starts[i] + sizes[i])
        throw py::value_error(std::string(names[i]) + " and " + names[j] +
                              " overlap; each Adam buffer must be its own memory");
  call.numel = n;
  return call;
}

// An engine dropped without close() closes in its destructor, which waits for the ops in
// flight and joins the I/O threads: not with the GIL held, or every Python thread stalls as
// long as the slowest op (the threads never call into Python, so releasing it is safe).
struct EngineDeleter {
  void operator()(infinity::Engine* engine) const {
    py::gil_scoped_release nogil;
    delete engine;
  }
};

// A pool dropped without close() closes in its destructor, which waits for the chunks in
// flight and joins the threads: not with the GIL held (the same reason as EngineDeleter).
struct TaskPoolDeleter {
  void operator()(infinity::TaskPool* pool) const {
    py::gil_scoped_release nogil;
    delete pool;
  }
};

// pieces == 0: one per pool thread, none smaller than min_piece bytes.
size_t resolve_pieces(int64_t pieces, int64_t nbytes, size_t min_piece, const infinity::TaskPool& pool) {
  if (pieces < 0) throw py::value_error("pieces is " + std::to_string(pieces) + "; it must be >= 0 (0: automatic)");
  if (pieces > 0) return static_cast<size_t>(pieces);
  return infinity::auto_pieces(nbytes > 0 ? static_cast<size_t>(nbytes) : 0, min_piece, pool.num_threads());
}

uint64_t submit_task(infinity::TaskPool& pool, std::unique_ptr<infinity::Task> task) {
  py::gil_scoped_release nogil;
  return pool.submit(std::move(task));
}

py::tuple result_tuple(const infinity::BatchResult& r) { return py::make_tuple(r.id, r.err, r.message); }

// Bytes of a C-contiguous buffer; anything strided would be checksummed wrong.
size_t contiguous_bytes(const py::buffer_info& info) {
  py::ssize_t expect = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    const size_t i = static_cast<size_t>(d);
    if (info.shape[i] > 1 && info.strides[i] != expect)
      throw py::value_error("crc32c needs a contiguous buffer; copy it first (bytes(view) or tensor.contiguous())");
    expect *= info.shape[i];
  }
  return static_cast<size_t>(info.size * info.itemsize);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Infinity's native core: async I/O engine, task pool, CRC32C, aligned memory.";

  static py::exception<infinity::AlignmentViolation> alignment_error(m, "AlignmentError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const infinity::AlignmentViolation& e) {
      py::set_error(alignment_error, e.what());
    } catch (const infinity::SysError& e) {
      py::object err = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "is", e.err(), e.what()));
      if (err) PyErr_SetObject(PyExc_OSError, err.ptr());
    }
  });

  m.def(
      "crc32c",
      [](uint64_t addr, int64_t nbytes, uint32_t seed) {
        if (nbytes < 0) throw py::value_error("nbytes is " + std::to_string(nbytes) + "; it must be >= 0");
        if (nbytes > 0 && addr == 0) throw py::value_error("address is 0 (a null pointer)");
        py::gil_scoped_release nogil;
        return infinity::crc32c(reinterpret_cast<const void*>(addr), static_cast<size_t>(nbytes), seed);
      },
      "addr"_a, "nbytes"_a, "seed"_a = 0,
      "CRC32C (Castagnoli) of nbytes at addr; pass a previous result as seed to continue it.");
  m.def(
      "crc32c_buffer",
      [](py::buffer data, uint32_t seed) {
        py::buffer_info info = data.request();
        const size_t n = contiguous_bytes(info);
        py::gil_scoped_release nogil;
        return infinity::crc32c(info.ptr, n, seed);
      },
      "data"_a, "seed"_a = 0, "CRC32C of a contiguous bytes-like object.");
  m.def(
      "crc32c_portable",
      [](py::buffer data, uint32_t seed) {
        py::buffer_info info = data.request();
        const size_t n = contiguous_bytes(info);
        py::gil_scoped_release nogil;
        return infinity::crc32c_portable(info.ptr, n, seed);
      },
      "data"_a, "seed"_a = 0, "CRC32C by the table method (for tests comparing the two paths).");
  m.def(
      "copy_bytes",
      [](uint64_t dst, uint64_t src, int64_t nbytes, int num_threads) {
        if (nbytes < 0) throw py::value_error("nbytes is " + std::to_string(nbytes) + "; it must be >= 0");
        if (nbytes > 0 && (dst == 0 || src == 0)) throw py::value_error("address is 0 (a null pointer)");
        const uint64_t n = static_cast<uint64_t>(nbytes);
        if (nbytes > 0 && dst < src + n && src < dst + n)
          throw py::value_error("source and destination overlap; copy_bytes needs disjoint buffers");
        py::gil_scoped_release nogil;
        infinity::copy_bytes(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                             static_cast<size_t>(nbytes), num_threads);
      },
      "dst"_a, "src"_a, "nbytes"_a, "num_threads"_a = 1,
      "Copy nbytes from src to dst (disjoint), with streaming stores for large copies.");
  m.def(
      "collapse_shared_memory",
      [](int fd, int64_t nbytes) {
        if (nbytes < 0) throw py::value_error("nbytes is " + std::to_string(nbytes) + "; it must be >= 0");
        py::gil_scoped_release nogil;
        return infinity::collapse_shared_memory(fd, static_cast<size_t>(nbytes));
      },
      "fd"_a, "nbytes"_a,
      "Give the first nbytes of shared-memory file fd 2 MiB pages (MADV_COLLAPSE); returns 0 "
      "or madvise's errno (EINVAL: unsupported or denied; ENOMEM, EAGAIN: memory too "
      "fragmented). Raises OSError when the temporary mapping cannot be made.");
  m.def("copy_implementation", &infinity::copy_implementation);
  m.def(
      "adam_step",
      [](uint64_t param, uint64_t grad, const std::string& grad_dtype, uint64_t exp_avg, uint64_t exp_avg_sq,
         uint64_t low, const std::string& low_dtype, int64_t numel, double lr, double beta1, double beta2,
         double eps, double weight_decay, int64_t step, bool decoupled, double grad_scale,
         const std::string& implementation) {
        const AdamCall call = adam_call(param, grad, grad_dtype, exp_avg, exp_avg_sq, low, low_dtype, numel, lr,
                                        beta1, beta2, eps, weight_decay, step, decoupled, grad_scale);
        bool ran = true;
        if (implementation == "bound") {  // the memory traffic alone, for benchmarks
          py::gil_scoped_release nogil;
          infinity::adam_bound_range(call.buffers, 0, call.numel);
        } else {
          py::gil_scoped_release nogil;
          ran = infinity::adam_step_range_with(implementation.c_str(), call.buffers, call.hyper, 0, call.numel);
        }
        if (!ran)
          throw py::value_error("implementation " + implementation + " cannot run on this CPU (it offers " +
                                infinity::adam_implementation() +
                                "); use auto, scalar, avx2 or avx512 (or bound, the memory traffic alone)");
      },
      "param"_a, "grad"_a, "grad_dtype"_a, "exp_avg"_a, "exp_avg_sq"_a, "low"_a, "low_dtype"_a, "numel"_a,
      py::kw_only(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a, "decoupled"_a,
      "grad_scale"_a = 1.0, "implementation"_a = "auto",
      "One Adam (decoupled=False) or AdamW step over numel fp32 elements in place, as torch's "
      "single-tensor Adam computes it; writes the parameter's low-precision copy in the same pass. "
      "implementation=\"bound\" moves the same bytes with one add each (a benchmark's bound; it "
      "overwrites the parameter).");
  m.def(
      "grad_stats",
      [](uint64_t grad, const std::string& dtype, int64_t numel) {
        if (numel < 0) throw py::value_error("numel is " + std::to_string(numel) + "; it must be >= 0");
        const infinity::ElementType t = element_type(dtype, "dtype");
        if (t == infinity::ElementType::kNone) throw py::value_error("dtype none has no elements to measure");
        if (numel > 0 && grad == 0) throw py::value_error("address is 0 (a null pointer)");
        infinity::GradStats st;
        {
          py::gil_scoped_release nogil;
          st = infinity::grad_stats_range(reinterpret_cast<const void*>(grad), t, 0, static_cast<size_t>(numel));
        }
        return py::make_tuple(st.sum_of_squares, st.nonfinite);
      },
      "grad"_a, "dtype"_a, "numel"_a,
      "(sum of squares in double, any inf or NaN) of a gradient's numel elements.");
  m.def(
      "dequantize",
      [](uint64_t codes, uint64_t scales, uint64_t out, const std::string& form, const std::string& dtype,
         int64_t rows, int64_t n, int64_t block, int num_threads) {
        if (rows < 0 || n < 0 || block < 0)
          throw py::value_error("rows, n and block must be >= 0 (they are " + std::to_string(rows) + ", " +
                                std::to_string(n) + ", " + std::to_string(block) + ")");
        if (form != "int8" && form != "int4") throw py::value_error("form is " + form + "; it must be int8 or int4");
        infinity::DequantBuffers b;
        b.codes = reinterpret_cast<const void*>(codes);
        b.scales = reinterpret_cast<const void*>(scales);
        b.out = reinterpret_cast<void*>(out);
        b.form = form == "int8" ? infinity::QuantForm::kInt8 : infinity::QuantForm::kInt4;
        b.type = element_type(dtype, "dtype");
        b.rows = static_cast<size_t>(rows);
        b.n = static_cast<size_t>(n);
        b.block = static_cast<size_t>(block);
        const std::string problem = infinity::dequantize_check(b);
        if (!problem.empty()) throw py::value_error(problem);
        py::gil_scoped_release nogil;
        infinity::dequantize(b, num_threads);
      },
      "codes"_a, "scales"_a, "out"_a, "form"_a, "dtype"_a, "rows"_a, "n"_a, "block"_a, "num_threads"_a = 1,
      "Write code * scale into out (dtype, rows x n) from block-wise int8 or int4 codes and their scales "
      "(dtype, rows x ceil(n / block)), in one pass (infinity.torch.quantize's format).");
  m.def("dequantize_implementation", &infinity::dequantize_implementation);
  m.def(
      "quant_linear",
      [](uint64_t x, uint64_t codes, uint64_t scales, uint64_t bias, uint64_t y, const std::string& form,
         const std::string& dtype, int64_t rows, int64_t n, int64_t out, int64_t block, int num_threads,
         const std::string& implementation) {
        if (rows < 0 || n < 0 || out < 0 || block < 0)
          throw py::value_error("rows, n, out and block must be >= 0 (they are " + std::to_string(rows) + ", " +
                                std::to_string(n) + ", " + std::to_string(out) + ", " + std::to_string(block) + ")");
        if (form != "int8" && form != "int4") throw py::value_error("form is " + form + "; it must be int8 or int4");
        infinity::QuantLinearBuffers b;
        b.x = reinterpret_cast<const void*>(x);
        b.codes = reinterpret_cast<const void*>(codes);
        b.scales = reinterpret_cast<const void*>(scales);
        b.bias = reinterpret_cast<const void*>(bias);
        b.y = reinterpret_cast<void*>(y);
        b.form = form == "int8" ? infinity::QuantForm::kInt8 : infinity::QuantForm::kInt4;
        b.type = element_type(dtype, "dtype");
        b.rows = static_cast<size_t>(rows);
        b.n = static_cast<size_t>(n);
        b.out = static_cast<size_t>(out);
        b.block = static_cast<size_t>(block);
        const std::string problem = infinity::quant_linear_check(b);
        if (!problem.empty()) throw py::value_error(problem);
        bool ran;
        {
          py::gil_scoped_release nogil;
          ran = infinity::quant_linear(b, num_threads, implementation.c_str());
        }
        if (!ran)
          throw py::value_error("implementation " + implementation + " cannot run on this CPU (it offers " +
                                infinity::quant_linear_implementation() + "); use auto, scalar, avx2 or avx512");
      },
      "x"_a, "codes"_a, "scales"_a, "bias"_a, "y"_a, "form"_a, "dtype"_a, "rows"_a, "n"_a, "out"_a, "block"_a,
      "num_threads"_a = 1, "implementation"_a = "auto",
      "Write y = x @ W.T (+ bias) (dtype, rows x out) from x (dtype, rows x n) and W's block-wise int8 or "
      "int4 codes and scales (dtype, out x ceil(n / block)), with no dequantized copy of W: float32 sums, "
      "one rounding (infinity.torch.quantize's format). bias: an address, or 0 for none.");
  m.def("quant_linear_implementation", &infinity::quant_linear_implementation,
        "\"avx512\" | \"avx2\" | \"scalar\": what implementation=\"auto\" runs here");
  m.def("adam_implementation", &infinity::adam_implementation, "\"avx512\" | \"avx2\" | \"scalar\"");
  m.def("crc32c_implementation", &infinity::crc32c_implementation);
  m.def("simd_level", &infinity::simd_level, "\"avx512\" | \"avx2\" | \"sse4.2\" | \"scalar\"");
  m.def("probe_io_uring", &infinity::probe_io_uring, py::call_guard<py::gil_scoped_release>(),
        "(usable, reason): whether io_uring works here, and why not.");
  m.def("probe_aio", &infinity::probe_aio, py::call_guard<py::gil_scoped_release>(),
        "(usable, reason): whether kernel AIO works here, and why not.");

  py::class_<infinity::AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init<size_t, size_t, bool>(), "nbytes"_a, "alignment"_a = 4096, "lock"_a = false,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("address",
                             [](const infinity::AlignedBuffer& b) { return reinterpret_cast<uint64_t>(b.data()); })
      .def_property_readonly("nbytes", &infinity::AlignedBuffer::nbytes)
      .def_property_readonly("alignment", &infinity::AlignedBuffer::alignment)
      .def_property_readonly("locked", &infinity::AlignedBuffer::locked)
      .def("__len__", &infinity::AlignedBuffer::nbytes)
      .def("__repr__",
           [](const infinity::AlignedBuffer& b) {
             return "<AlignedBuffer " + std::to_string(b.nbytes()) + " bytes at " +
                    infinity::hex(reinterpret_cast<uint64_t>(b.data())) + (b.locked() ? ", locked>" : ">");
           })
      .def_buffer([](infinity::AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {static_cast<py::ssize_t>(1)},
                               /*readonly=*/false);
      });

  // Below these a piece is not worth a thread's wake-up.
  constexpr size_t kMinCopyPiece = size_t(4) << 20;
  constexpr size_t kMinCrcPiece = size_t(1) << 20;
  py::class_<infinity::TaskPool, std::unique_ptr<infinity::TaskPool, TaskPoolDeleter>>(m, "TaskPool")
      .def(py::init<int, const std::string&>(), "num_threads"_a, "thread_name"_a = "infinity-task",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_threads", &infinity::TaskPool::num_threads)
      .def_property_readonly("completion_fd", &infinity::TaskPool::completion_fd)
      .def(
          "submit_copy",
          [](infinity::TaskPool& p, uint64_t dst, uint64_t src, int64_t nbytes, int64_t pieces) {
            auto task = std::make_unique<infinity::CopyTask>(dst, src, nbytes,
                                                             resolve_pieces(pieces, nbytes, kMinCopyPiece, p));
            return submit_task(p, std::move(task));
          },
          "dst"_a, "src"_a, "nbytes"_a, "pieces"_a = 0,
          "Queue a copy of nbytes from src to dst (disjoint); returns the task id.")
      .def(
          "submit_fill",
          [](infinity::TaskPool& p, uint64_t dst, int64_t nbytes, int value, int64_t pieces) {
            auto task = std::make_unique<infinity::FillTask>(dst, nbytes, value,
                                                             resolve_pieces(pieces, nbytes, kMinCopyPiece, p));
            return submit_task(p, std::move(task));
          },
          "dst"_a, "nbytes"_a, "value"_a = 0, "pieces"_a = 0,
          "Queue setting nbytes at dst to the byte value; returns the task id.")
      .def(
          "submit_crc32c",
          [](infinity::TaskPool& p, uint64_t addr, int64_t nbytes, uint64_t crc_addr, int64_t crc_block_bytes,
             bool verify, int64_t pieces) {
            auto task = std::make_unique<infinity::Crc32cTask>(addr, nbytes, crc_addr, crc_block_bytes, verify,
                                                               resolve_pieces(pieces, nbytes, kMinCrcPiece, p));
            return submit_task(p, std::move(task));
          },
          "addr"_a, "nbytes"_a, "crc_addr"_a, "crc_block_bytes"_a, "verify"_a = false, "pieces"_a = 0,
          "Queue the CRC32C of each crc_block_bytes block into uint32[] at crc_addr (verify: compare with "
          "what is there, failing with EBADMSG); returns the task id.")
      .def(
          "submit_adam",
          [](infinity::TaskPool& p, uint64_t param, uint64_t grad, const std::string& grad_dtype, uint64_t exp_avg,
             uint64_t exp_avg_sq, uint64_t low, const std::string& low_dtype, int64_t numel, double lr,
             double beta1, double beta2, double eps, double weight_decay, int64_t step, bool decoupled,
             double grad_scale, int64_t chunk_elements) {
            const AdamCall call = adam_call(param, grad, grad_dtype, exp_avg, exp_avg_sq, low, low_dtype, numel,
                                            lr, beta1, beta2, eps, weight_decay, step, decoupled, grad_scale);
            auto task = std::make_unique<infinity::AdamTask>(call.buffers, call.hyper, numel, chunk_elements);
            return submit_task(p, std::move(task));
          },
          "param"_a, "grad"_a, "grad_dtype"_a, "exp_avg"_a, "exp_avg_sq"_a, "low"_a, "low_dtype"_a, "numel"_a,
          py::kw_only(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a, "decoupled"_a,
          "grad_scale"_a = 1.0, "chunk_elements"_a = 1 << 20,
          "Queue one Adam / AdamW step (see adam_step) over numel elements, in chunks of chunk_elements run "
          "by the pool's threads; returns the task id.")
      .def("poll",
           [](infinity::TaskPool& p) {
             std::vector<infinity::TaskResult> done;
             {
               py::gil_scoped_release nogil;
               done = p.poll();
             }
             py::list out;
             for (const auto& r : done) out.append(py::make_tuple(r.id, r.err, r.message));
             return out;
           })
      .def(
          "wait",
          [](infinity::TaskPool& p, uint64_t task_id, double timeout_s) {
            infinity::TaskResult r;
            infinity::WaitStatus st;
            {
              py::gil_scoped_release nogil;
              st = p.wait(task_id, timeout_s, &r);
            }
            if (st == infinity::WaitStatus::kTimeout) {
              PyErr_SetString(PyExc_TimeoutError,
                              ("task " + std::to_string(task_id) + " did not complete in time").c_str());
              throw py::error_already_set();
            }
            if (st == infinity::WaitStatus::kUnknown)
              throw py::key_error("task " + std::to_string(task_id) + " is unknown or was already reported");
            return py::make_tuple(r.err, r.message);
          },
          "task_id"_a, "timeout_s"_a = -1.0)
      .def("close", &infinity::TaskPool::close, py::call_guard<py::gil_scoped_release>())
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](infinity::TaskPool& p, py::args) {
        py::gil_scoped_release nogil;
        p.close();
      });

  py::class_<infinity::Engine, std::unique_ptr<infinity::Engine, EngineDeleter>>(m, "Engine")
      .def(py::init<int, int, int64_t, const std::string&, int64_t>(), "num_threads"_a, "queue_depth"_a,
           "block_size_bytes"_a, "backend"_a = "auto", "staging_bytes"_a = int64_t(4) << 20,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("backend", &infinity::Engine::backend)
      .def_property_readonly("backend_note", &infinity::Engine::backend_note)
      .def_property_readonly("completion_fd", &infinity::Engine::completion_fd)
      .def_property_readonly("staged_bytes", &infinity::Engine::staged_bytes)
      .def(
          "submit",
          [](infinity::Engine& e, const py::sequence& ops) {
            std::vector<infinity::OpSpec> specs;
            specs.reserve(ops.size());
            for (size_t i = 0; i < ops.size(); ++i) specs.push_back(parse_op(ops[i], i));
            py::gil_scoped_release nogil;
            return e.submit(specs);
          },
          "ops"_a)
      .def("poll",
           [](infinity::Engine& e) {
             std::vector<infinity::BatchResult> done;
             {
               py::gil_scoped_release nogil;
               done = e.poll();
             }
             py::list out;
             for (const auto& r : done) out.append(result_tuple(r));
             return out;
           })
      .def(
          "wait",
          [](infinity::Engine& e, uint64_t batch_id, double timeout_s) {
            infinity::BatchResult r;
            infinity::WaitStatus st;
            {
              py::gil_scoped_release nogil;
              st = e.wait(batch_id, timeout_s, &r);
            }
            if (st == infinity::WaitStatus::kTimeout) {
              PyErr_SetString(PyExc_TimeoutError,
                              ("batch " + std::to_string(batch_id) + " did not complete in time").c_str());
              throw py::error_already_set();
            }
            if (st == infinity::WaitStatus::kUnknown)
              throw py::key_error("batch " + std::to_string(batch_id) + " is unknown or was already reported");
            return py::make_tuple(r.err, r.message);
          },
          "batch_id"_a, "timeout_s"_a = -1.0)
      .def("close", &infinity::Engine::close, py::call_guard<py::gil_scoped_release>())
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](infinity::Engine& e, py::args) {
        py::gil_scoped_release nogil;
        e.close();
      });
}
