// Tensor types at the edge of the `ddp::tensor` concept (issue #13, defects 5 and 9). CMake
// compiles this file once per case (-DDDP_CASE_<name>): the "accept" cases must compile without a
// warning, the "reject" cases must fail with a first error that names the concept.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/local/communicator.hpp>
#include <ddp/tensor.hpp>

namespace fake {
// Models at::Tensor: a handle whose copies share one storage, whose data() is const but returns a
// mutable pointer, and whose numel() is signed.
struct handle {
  std::shared_ptr<std::vector<float>> storage = std::make_shared<std::vector<float>>(4);
  [[nodiscard]] float* data() const { return storage->data(); }
  [[nodiscard]] std::int64_t numel() const { return static_cast<std::int64_t>(storage->size()); }
};
// The same handle with traits written the naive way: data() takes a non-const reference.
struct mutable_only {
  std::shared_ptr<std::vector<float>> storage = std::make_shared<std::vector<float>>(4);
};
// Sizes that are no element count.
struct bool_size {
  std::vector<float> v = std::vector<float>(4);
};
struct not_a_tensor {};
}  // namespace fake

template <>
struct ddp::tensor_traits<fake::handle> {
  static constexpr bool is_handle = true;
  static void* data(const fake::handle& t) { return t.data(); }
  static std::int64_t size(const fake::handle& t) { return t.numel(); }  // torch's numel(): int64_t
  static ddp::dtype dtype(const fake::handle&) { return ddp::dtype::f32; }
  static ddp::device device(const fake::handle&) { return ddp::device::host(); }
};
template <>
struct ddp::tensor_traits<fake::mutable_only> {
  static void* data(fake::mutable_only& t) { return t.storage->data(); }
  static long size(const fake::mutable_only& t) { return static_cast<long>(t.storage->size()); }
  static ddp::dtype dtype(const fake::mutable_only&) { return ddp::dtype::f32; }
  static ddp::device device(const fake::mutable_only&) { return ddp::device::host(); }
};
template <>
struct ddp::tensor_traits<fake::bool_size> {
  static void* data(fake::bool_size& t) { return t.v.data(); }
  static bool size(const fake::bool_size& t) { return !t.v.empty(); }
  static ddp::dtype dtype(const fake::bool_size&) { return ddp::dtype::f32; }
  static ddp::device device(const fake::bool_size&) { return ddp::device::host(); }
};

std::size_t use(ddp::local::communicator& comm) {
  fake::handle h;
  [[maybe_unused]] const fake::handle& ch = h;  // what `p.grad()` returns
  fake::mutable_only m;
  [[maybe_unused]] const fake::mutable_only& cm = m;
  [[maybe_unused]] fake::bool_size b;
  [[maybe_unused]] fake::not_a_tensor n;
  [[maybe_unused]] ddp::Bucketer grads(comm);
  [[maybe_unused]] ddp::BufferReducer buffers(comm);
#if defined(DDP_CASE_signed_size)
  return ddp::view(h).count + ddp::view(m).count;  // int64_t and long sizes
#elif defined(DDP_CASE_const_handle)
  return ddp::view(ch).count;  // a const handle whose traits take const T&
#elif defined(DDP_CASE_const_handle_gradient)
  return grads.add(ch);  // p.grad() returns const at::Tensor&
#elif defined(DDP_CASE_const_handle_buffer)
  return buffers.add(ch);
#elif defined(DDP_CASE_const_mutable_only)
  return ddp::view(cm).count;  // traits take T&: rejected, naming the concept and the fix
#elif defined(DDP_CASE_bool_size)
  return ddp::view(b).count;
#elif defined(DDP_CASE_not_a_tensor_view)
  return ddp::view(n).count;
#elif defined(DDP_CASE_not_a_tensor_bucketer)
  return grads.add(n);
#elif defined(DDP_CASE_not_a_tensor_parameter)
  std::vector<float> g(4);
  return grads.add(n, g);
#elif defined(DDP_CASE_temporary_gradient)
  return grads.add(std::vector<float>(4));  // would dangle: the Bucketer keeps a reference
#elif defined(DDP_CASE_const_mutable_only_buffer)
  return buffers.add(cm);
#elif defined(DDP_CASE_temporary_handle_view)
  std::vector<float> v(4);
  return ddp::view(std::span<float>(v)).count;  // a temporary handle: it borrows v
#elif defined(DDP_CASE_temporary_vector_view)
  return ddp::view(std::vector<float>(4)).count;  // would dangle
#else
#error "no DDP_CASE_ given"
#endif
}
