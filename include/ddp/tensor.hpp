#pragma once
/// @file tensor.hpp
/// @brief How any tensor type plugs in: `tensor_traits<T>` (the customization point), the
/// `tensor` concept that checks it, and `tensor_view`, the non-owning view every component uses.
///
/// Contiguous, sized ranges of supported element types (`std::vector<float>`, `std::span<double>`,
/// `std::array<std::int64_t, N>`) work with no user code. For an own type, specialise:
/// @code
/// template <> struct ddp::tensor_traits<my::Tensor> {
///   static void* data(my::Tensor& t) { return t.ptr; }
///   static std::size_t size(const my::Tensor& t) { return t.numel; }
///   static ddp::dtype dtype(const my::Tensor& t) { return t.is_half ? ddp::dtype::f16 : ddp::dtype::f32; }
///   static ddp::device device(const my::Tensor& t) { return t.on_gpu ? ddp::device::cuda(t.gpu) : ddp::device::host(); }
/// };
/// @endcode

#include <cstddef>
#include <ranges>
#include <span>
#include <type_traits>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>

namespace ddp {

/// Non-owning view of a tensor's memory (DLPack-shaped, without shape: the library only needs bytes).
struct tensor_view {
  void* data = nullptr;   ///< first element (host or device pointer, per `where`)
  std::size_t count = 0;  ///< number of elements
  ddp::dtype type = dtype::f32;        ///< element type
  ddp::device where = device::host();  ///< memory `data` points into

  /// Size of the viewed memory: `count * size_of(type)`.
  [[nodiscard]] std::size_t bytes() const noexcept { return count * size_of(type); }
  /// `data` as a byte pointer, for offset arithmetic and memcpy.
  [[nodiscard]] std::byte* byte_data() const noexcept { return static_cast<std::byte*>(data); }

  /// Elements [offset, offset + n) of this view.
  [[nodiscard]] tensor_view slice(std::size_t offset, std::size_t n) const noexcept {
    return {byte_data() + offset * size_of(type), n, type, where};
  }
  /// Typed access for host memory; T must match `type`.
  template <element T>
  [[nodiscard]] std::span<T> as() const noexcept {
    return {static_cast<T*>(data), count};
  }
};

/// Customization point. The primary template is empty: a type is a tensor only once a
/// specialisation provides `data`, `size`, `dtype` and `device` (checked by the `tensor` concept).
template <class T, class Enable = void>
struct tensor_traits {};

/// Contiguous sized ranges of element types are tensors out of the box (host memory).
template <class R>
  requires std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
           element<std::ranges::range_value_t<R>> &&
           (!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>)
struct tensor_traits<R> {
  using value_type = std::ranges::range_value_t<R>;  ///< element type of the range
  /// `std::ranges::data(r)`.
  static void* data(R& r) noexcept { return static_cast<void*>(std::ranges::data(r)); }
  /// `std::ranges::size(r)`, in elements.
  static std::size_t size(const R& r) noexcept { return static_cast<std::size_t>(std::ranges::size(r)); }
  /// The dtype of `value_type`.
  static ddp::dtype dtype(const R&) noexcept { return dtype_v<value_type>; }
  /// Always host: a range's storage is host memory.
  static ddp::device device(const R&) noexcept { return device::host(); }
};

/// A type the library can read and write in place: mutable data pointer, element count, dtype, device.
template <class T>
concept tensor = requires(std::remove_cvref_t<T>& t, const std::remove_cvref_t<T>& ct) {
  { tensor_traits<std::remove_cvref_t<T>>::data(t) } -> std::convertible_to<void*>;
  { tensor_traits<std::remove_cvref_t<T>>::size(ct) } -> std::convertible_to<std::size_t>;
  { tensor_traits<std::remove_cvref_t<T>>::dtype(ct) } -> std::same_as<ddp::dtype>;
  { tensor_traits<std::remove_cvref_t<T>>::device(ct) } -> std::same_as<ddp::device>;
};

/// The view of a tensor. `tensor_view` itself is accepted too (identity).
template <class T>
  requires tensor<T> || std::same_as<std::remove_cvref_t<T>, tensor_view>
[[nodiscard]] tensor_view view(T& t) {
  if constexpr (std::same_as<std::remove_cvref_t<T>, tensor_view>) {
    return t;
  } else {
    using traits = tensor_traits<std::remove_cvref_t<T>>;
    return {traits::data(t), traits::size(t), traits::dtype(t), traits::device(t)};
  }
}

}  // namespace ddp
