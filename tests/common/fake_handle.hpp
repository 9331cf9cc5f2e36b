#pragma once
// A tensor "handle" that models at::Tensor without depending on libtorch: copies share one
// storage (a shared_ptr), data() is const yet returns a mutable pointer, numel() is signed, and a
// default-constructed handle is "undefined" (no storage, 0 elements), like a gradient set to None.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <ddp/tensor.hpp>

namespace fake {

struct handle {
  std::shared_ptr<std::vector<float>> storage;

  handle() = default;  // undefined, like torch's None gradient
  explicit handle(std::size_t n, float fill = 0.0f) : storage(std::make_shared<std::vector<float>>(n, fill)) {}

  [[nodiscard]] float* data() const noexcept { return storage ? storage->data() : nullptr; }
  [[nodiscard]] std::int64_t numel() const noexcept { return storage ? static_cast<std::int64_t>(storage->size()) : 0; }
  float& operator[](std::size_t i) const { return (*storage)[i]; }
};

}  // namespace fake

template <>
struct ddp::tensor_traits<fake::handle> {
  static constexpr bool is_handle = true;  // copies share the storage: components hold it by value
  static void* data(const fake::handle& t) noexcept { return t.data(); }  // const, yet mutable data
  static std::int64_t size(const fake::handle& t) noexcept { return t.numel(); }
  static ddp::dtype dtype(const fake::handle&) noexcept { return ddp::dtype::f32; }
  static ddp::device device(const fake::handle&) noexcept { return ddp::device::host(); }
};
