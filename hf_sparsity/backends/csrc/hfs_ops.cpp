// The decode custom ops in C++ (hf_sparsity/backends/ops.py builds this on request with
// torch.utils.cpp_extension): compiled graphs call them through the dispatcher without any Python,
// ~10 us less per sparse layer than the Python-implemented hf_sparsity:: ops. The kernels are the
// ones hfs_kernels.c builds; their addresses come from the ctypes-loaded library (set_kernels).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>

namespace {

using run_fn = void (*)(int, int64_t, int64_t, int64_t, int, const int64_t*, const void*, const void*, int,
                        const float*, float*, int64_t, const float*);
using matmul_fn = void (*)(int, int64_t, int64_t, int64_t, int, const int64_t*, const void*, const float*,
                           const float*, float*, int64_t, const float*);
run_fn g_run = nullptr;
matmul_fn g_matmul = nullptr;
constexpr int64_t kMinWork = 16384;  // _native.MIN_WORK_PER_THREAD

int64_t set_kernels(int64_t run, int64_t matmul) {
  g_run = reinterpret_cast<run_fn>(run);
  g_matmul = reinterpret_cast<matmul_fn>(matmul);
  return 0;
}

int64_t threads_for(int64_t work, int64_t nthreads) {
  if (nthreads > 0) return nthreads;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work / kMinWork));
}

const void* ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

at::Tensor fp32_bias(const std::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return at::Tensor();
  return bias->to(at::kFloat).contiguous();
}

at::Tensor out_like(const at::Tensor& x, int64_t rows) {
  auto sizes = x.sizes().vec();
  sizes.back() = rows;
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& values, const std::optional<at::Tensor>& meta,
                         const std::optional<at::Tensor>& rowptr, const std::optional<at::Tensor>& bias,
                         std::string_view op, int64_t rows, int64_t nnz, int64_t nthreads) {
  TORCH_CHECK(g_run != nullptr, "hf_sparsity_cpp: kernels not set");
  const int code = op == "bitmask" ? 0 : op == "nm24" ? 1 : op == "gemv" ? 2 : -1;
  TORCH_CHECK(code >= 0, "hf_sparsity_cpp::packed_linear: unknown op");
  const int64_t in_f = x.size(-1);
  at::Tensor x2d = x.reshape({-1, in_f}).to(at::kFloat).contiguous();
  const int64_t batch = x2d.size(0);
  const int64_t nt = threads_for(nnz * batch, nthreads);
  at::Tensor y = out_like(x, rows);
  at::Tensor b = fp32_bias(bias);
  if (batch > 0 && rows > 0) {
    g_run(code, rows, in_f, (rows + nt - 1) / nt, static_cast<int>(nt),
          static_cast<const int64_t*>(ptr(rowptr)), ptr(meta), values.data_ptr(),
          values.scalar_type() == at::kChar ? 2 : values.scalar_type() == at::kBFloat16 ? 1 : 0, x2d.data_ptr<float>(), y.data_ptr<float>(), batch,
          b.defined() ? b.data_ptr<float>() : nullptr);
  } else if (b.defined()) {
    y.copy_(b.expand_as(y));
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor csr_linear(const at::Tensor& x, const at::Tensor& rowptr, const at::Tensor& idx, const at::Tensor& values,
                      const std::optional<at::Tensor>& bias, int64_t rows, int64_t nthreads) {
  TORCH_CHECK(g_matmul != nullptr, "hf_sparsity_cpp: kernels not set");
  const int64_t in_f = x.size(-1);
  at::Tensor x2d = x.reshape({-1, in_f}).to(at::kFloat).contiguous();
  const int64_t batch = x2d.size(0);
  const int64_t nt = threads_for(values.numel() * batch, nthreads);
  at::Tensor y = out_like(x, rows);
  at::Tensor b = fp32_bias(bias);
  if (batch > 0 && rows > 0) {
    const int kind = idx.scalar_type() == at::kShort ? 0 : 1;
    g_matmul(kind, rows, in_f, (rows + nt - 1) / nt, static_cast<int>(nt), rowptr.data_ptr<int64_t>(),
             idx.data_ptr(), values.data_ptr<float>(), x2d.data_ptr<float>(), y.data_ptr<float>(), batch,
             b.defined() ? b.data_ptr<float>() : nullptr);
  } else if (b.defined()) {
    y.copy_(b.expand_as(y));
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(hf_sparsity_cpp, m) {
  m.def("set_kernels(int run, int matmul) -> int", &set_kernels);
  m.def(
      "packed_linear(Tensor x, Tensor values, Tensor? meta, Tensor? rowptr, Tensor? bias, str op, int rows, "
      "int nnz, int nthreads) -> Tensor");
  m.def("csr_linear(Tensor x, Tensor rowptr, Tensor idx, Tensor values, Tensor? bias, int rows, int nthreads) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_sparsity_cpp, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("csr_linear", &csr_linear);
}
