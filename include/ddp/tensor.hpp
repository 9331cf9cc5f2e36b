#pragma once
/// @file tensor.hpp
/// @brief How any tensor type plugs in: `tensor_traits<T>` (the customization point), the
/// `tensor` concept that checks it, `is_tensor_handle_v` (copies share storage), and
/// `tensor_view`, the non-owning view every component uses.
///
/// Contiguous, sized ranges of supported element types work with no user code; another type
/// specialises `tensor_traits` (`data`, `size`, `dtype`, `device`, optionally `is_handle`).
/// Examples, handles, const handles and what a component keeps: docs/tensors.md.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>

namespace ddp {

/// Non-owning view of a tensor's memory (DLPack-shaped, without shape: the library only needs bytes).
struct tensor_view {
  void* data = nullptr;                ///< first element (host or device pointer, per `where`)
  std::size_t count = 0;               ///< number of elements
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
/// Optional: `static constexpr bool is_handle` (see `is_tensor_handle_v`).
template <class T, class Enable = void>
struct tensor_traits {};

namespace detail {
/// A contiguous sized range of an element type whose elements are mutable.
template <class R>
concept element_range = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    element<std::ranges::range_value_t<R>> &&
    (!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>);
}  // namespace detail

/// Contiguous sized ranges of element types are tensors out of the box (host memory).
/// (Selected through `Enable`, not a requires-clause: nvcc 13's front end stops matching a
/// constrained partial specialisation here once the `tensor` concept instantiated it once.)
template <class R>
struct tensor_traits<R, std::enable_if_t<detail::element_range<R>>> {
  using value_type = std::ranges::range_value_t<R>;  ///< element type of the range
  /// A borrowed, copyable range (`std::span<float>`) is a view: its copies share the elements.
  static constexpr bool is_handle = std::ranges::borrowed_range<R> && std::copyable<R>;
  /// `std::ranges::data(r)`.
  static void* data(R& r) noexcept { return static_cast<void*>(std::ranges::data(r)); }
  /// `std::ranges::data(r)` of a const range whose elements stay mutable (`const std::span<float>`).
  static void* data(const R& r) noexcept requires std::ranges::contiguous_range<const R> &&
      (!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<const R>>>) {
    return static_cast<void*>(std::ranges::data(r));
  }
  /// `std::ranges::size(r)`, in elements.
  static std::size_t size(const R& r) noexcept { return static_cast<std::size_t>(std::ranges::size(r)); }
  /// The dtype of `value_type`.
  static ddp::dtype dtype(const R&) noexcept { return dtype_v<value_type>; }
  /// Always host: a range's storage is host memory.
  static ddp::device device(const R&) noexcept { return device::host(); }
};

namespace detail {

/// Always false, for a `static_assert` that must depend on `T`.
template <class T>
inline constexpr bool not_a_tensor_v = false;

/// What `tensor_traits<T>::size` may return: any integer type but `bool`. Signed counts are
/// checked by `view()` (a negative one is a `usage_error`).
template <class N>
concept element_count = std::integral<std::remove_cvref_t<N>> && !std::same_as<std::remove_cvref_t<N>, bool>;

/// The traits of `T`, whatever its cv-qualifiers and reference.
template <class T>
using traits_of = tensor_traits<std::remove_cvref_t<T>>;

/// `traits_of<T>` provides the four functions, for a mutable `T` (constness aside).
template <class T>
concept has_tensor_traits = requires(std::remove_cvref_t<T>& t, const std::remove_cvref_t<T>& ct) {
  traits_of<T>::data(t);
  traits_of<T>::size(ct);
  traits_of<T>::dtype(ct);
  traits_of<T>::device(ct);
};

}  // namespace detail

/// A type the library can read and write in place: mutable data pointer, element count, dtype,
/// device, all read through `tensor_traits<std::remove_cvref_t<T>>`.
///
/// The data pointer is asked of a `T&` with T's own constness: `tensor<const X>` holds only if
/// the traits offer `data(const X&)`, which is right for a handle whose constness does not
/// protect its data (`at::Tensor::data_ptr()` is const and returns a mutable pointer) and wrong
/// for a container (`const std::vector<float>` is not a tensor). `size` may return any integer
/// type but `bool` (`int64_t` numel included); `view()` rejects a negative one at run time.
template <class T>
concept tensor = requires(std::remove_reference_t<T>& t, const std::remove_cvref_t<T>& ct) {
  { detail::traits_of<T>::data(t) } -> std::convertible_to<void*>;
  { detail::traits_of<T>::size(ct) } -> detail::element_count;
  { detail::traits_of<T>::dtype(ct) } -> std::convertible_to<ddp::dtype>;
  { detail::traits_of<T>::device(ct) } -> std::convertible_to<ddp::device>;
};

/// True for a tensor type whose copies share one storage, so that a component may hold a copy
/// instead of a reference: `tensor_traits<T>::is_handle` where the traits declare it (true for
/// `at::Tensor`-like handles, for `std::span` and other borrowed ranges), false otherwise
/// (`std::vector`, whose copy is another buffer).
template <class T>
inline constexpr bool is_tensor_handle_v = [] {
  if constexpr (requires {
                  { detail::traits_of<T>::is_handle } -> std::convertible_to<bool>;
                }) {
    return static_cast<bool>(detail::traits_of<T>::is_handle);
  } else {
    return false;
  }
}();

namespace detail {

/// A type that `view()` and the components accept: a `tensor`, or a `tensor_view`.
template <class T>
concept viewable = tensor<T> || std::same_as<std::remove_cvref_t<T>, tensor_view>;

/// Explains at compile time why `T` is not a `ddp::tensor`, with one readable message ahead of
/// the template errors (callers use it in the branch that rejects `T`).
template <class T>
constexpr void explain_not_a_tensor() {
  using U = std::remove_reference_t<T>;
  if constexpr (!has_tensor_traits<T>) {
    static_assert(has_tensor_traits<T>,
                  "this type is not a ddp::tensor: it is neither a contiguous sized range of a ddp element type "
                  "(std::vector<float>, std::span<double>, ...) nor a type with a ddp::tensor_traits<T> specialisation "
                  "providing data(T&), size(const T&), dtype(const T&) and device(const T&) (see docs/tensors.md)");
  } else if constexpr (std::is_const_v<U> && !requires(U & t) { traits_of<T>::data(t); }) {
    static_assert(!std::is_const_v<U>,
                  "a const T is not a ddp::tensor: ddp::tensor_traits<T>::data takes a non-const T&, so the library "
                  "cannot write through a const one. Pass a non-const T, or, for a handle type whose constness does "
                  "not protect its data (like at::Tensor), declare `static void* data(const T&)` and `static "
                  "constexpr bool is_handle = true;` in ddp::tensor_traits<T> (see docs/tensors.md)");
  } else if constexpr (!requires(U & t) {
                         { traits_of<T>::data(t) } -> std::convertible_to<void*>;
                       }) {
    static_assert(not_a_tensor_v<T>,
                  "this type is not a ddp::tensor: ddp::tensor_traits<T>::data must return a mutable pointer "
                  "(convertible to void*; a pointer to const data cannot be written)");
  } else if constexpr (!requires(const std::remove_cvref_t<T>& t) {
                         { traits_of<T>::size(t) } -> element_count;
                       }) {
    static_assert(not_a_tensor_v<T>,
                  "this type is not a ddp::tensor: ddp::tensor_traits<T>::size must return an integer type (signed "
                  "is fine: a negative count is a usage_error at run time)");
  } else if constexpr (!requires(const std::remove_cvref_t<T>& t) {
                         { traits_of<T>::dtype(t) } -> std::convertible_to<ddp::dtype>;
                       }) {
    static_assert(not_a_tensor_v<T>,
                  "this type is not a ddp::tensor: ddp::tensor_traits<T>::dtype must return ddp::dtype");
  } else {
    static_assert(tensor<T>, "this type is not a ddp::tensor: ddp::tensor_traits<T>::device must return ddp::device");
  }
}

/// An element count from `tensor_traits<T>::size` as `std::size_t`.
/// @throws usage_error if it is negative or does not fit
template <class N>
[[nodiscard]] std::size_t checked_count(N n) {
  if constexpr (std::is_signed_v<N>) {
    if (n < 0) {
      throw usage_error(-1, "ddp::view",
                        "ddp::tensor_traits<T>::size returned " + std::to_string(static_cast<long long>(n)) +
                            ": an element count must not be negative");
    }
  }
  if constexpr (std::numeric_limits<std::make_unsigned_t<N>>::digits > std::numeric_limits<std::size_t>::digits) {
    if (static_cast<std::make_unsigned_t<N>>(n) > std::numeric_limits<std::size_t>::max()) {
      throw usage_error(-1, "ddp::view", "ddp::tensor_traits<T>::size returned a count too large for std::size_t");
    }
  }
  return static_cast<std::size_t>(n);
}

}  // namespace detail

/// The view of a tensor. `tensor_view` itself is accepted too (identity). `t` may be const when
/// `tensor<const T>` holds (a handle whose traits take `const T&`).
/// @throws usage_error if the traits report a negative element count
template <class T>
requires detail::viewable<T>
[[nodiscard]] tensor_view view(T& t) {
  if constexpr (std::same_as<std::remove_cvref_t<T>, tensor_view>) {
    return t;
  } else {
    using traits = detail::traits_of<T>;
    return {traits::data(t), detail::checked_count(traits::size(std::as_const(t))), traits::dtype(std::as_const(t)),
            traits::device(std::as_const(t))};
  }
}

/// Any other type: a compile error that names the `ddp::tensor` concept and what to fix.
template <class T>
requires(!detail::viewable<T>) tensor_view view(T&) {
  detail::explain_not_a_tensor<T>();
  return {};
}

/// The view of a temporary handle (`std::span`, `at::Tensor`: its data outlives it), which the
/// components accept too (docs/tensors.md). A temporary of another tensor type would leave the
/// view dangling: a compile error that says so.
template <class T>
requires(!std::is_lvalue_reference_v<T> && detail::viewable<T>) [[nodiscard]] tensor_view view(T&& t) {
  static_assert(is_tensor_handle_v<std::remove_cvref_t<T>> || std::same_as<std::remove_cvref_t<T>, tensor_view>,
                "ddp::view of a temporary that is not a handle (a std::vector returned by value, ...): the view "
                "would dangle once the temporary dies. Keep the tensor in a variable, or, if copies of the type "
                "share one storage, declare `static constexpr bool is_handle = true;` in ddp::tensor_traits<T> "
                "(docs/tensors.md)");
  return view(t);
}

namespace detail {

/// `view()` of the `T` behind `object`, for components that keep a type-erased pointer to a
/// registered tensor (their own copy of a handle, or the trainer's object) and re-read it.
template <class T>
[[nodiscard]] tensor_view reread_view(void* object) {
  return ddp::view(*static_cast<T*>(object));
}

/// Where a component re-reads a registered tensor: nowhere (a fixed view), the trainer's own
/// object (a reference: it must outlive the component), or the component's own copy of a handle.
class tensor_source {
 public:
  /// Nothing to re-read: the view given at registration stays.
  tensor_source() = default;

  /// Re-reads `object`, which the caller keeps alive while the component holds this source.
  template <class T>
  [[nodiscard]] static tensor_source referring_to(T& object) {
    tensor_source s;
    s.object_ = const_cast<std::remove_const_t<T>*>(std::addressof(object));
    s.read_ = &reread_view<T>;
    return s;
  }

  /// Holds `handle` (a copy sharing the trainer's storage) and re-reads it.
  template <class H>
  [[nodiscard]] static tensor_source holding(H handle) {
    auto held = std::make_shared<H>(std::move(handle));
    tensor_source s;
    s.object_ = held.get();
    s.held_ = std::move(held);
    s.read_ = &reread_view<H>;
    return s;
  }

  /// False for a fixed view.
  [[nodiscard]] bool rereads() const noexcept { return read_ != nullptr; }
  /// The current view of the source (precondition: `rereads()`).
  [[nodiscard]] tensor_view read() const { return read_(object_); }
  /// The object re-read (the trainer's, or the held copy); null for a fixed view.
  [[nodiscard]] void* object() const noexcept { return object_; }
  /// The re-read function; null for a fixed view.
  [[nodiscard]] auto reader() const noexcept { return read_; }

 private:
  void* object_ = nullptr;
  tensor_view (*read_)(void*) = nullptr;
  std::shared_ptr<void> held_;  // keeps a held handle alive; shared by copies of this source
};

}  // namespace detail

}  // namespace ddp
