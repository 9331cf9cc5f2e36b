#pragma once
/// @file local_steps/outer_exchange.hpp
/// @brief How DiLoCo's outer gradients travel: `outer_wire` (their own dtype, bf16, or 8 bits
/// with a scale), and the exchange that averages them over ranks, started in one call and
/// completed in another so that inner steps can run in between (Streaming DiLoCo's overlap).
/// Every replica ends with the same bits. docs/local-steps.md.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// The type outer gradients are sent in.
enum class outer_wire : std::uint8_t {
  /// Their own dtype, averaged by `allreduce_average` (ddp's one rule).
  native,
  /// bfloat16: divided by the rank count in their own type (the rule), rounded to nearest even,
  /// summed by the backend (which gives every rank the same bits), widened back.
  bf16,
  /// 8-bit integers with one f32 scale per tensor and rank (`max |x| / 127`, values rounded to
  /// nearest even and clamped to [-127, 127]); gathered from every rank (an allgather of bytes),
  /// then every rank dequantizes and sums them in rank order in f64 and multiplies by `1/size`:
  /// the same bits everywhere, whatever the backend. A non-finite outer gradient gives NaN.
  int8,
};

/// Name of `w` ("native", "bf16", "int8").
[[nodiscard]] constexpr const char* name_of(outer_wire w) noexcept {
  switch (w) {
    case outer_wire::native: return "native";
    case outer_wire::bf16: return "bf16";
    case outer_wire::int8: return "int8";
  }
  return "?";
}

namespace detail {

/// The average over ranks of a fixed list of host tensors (the outer gradients of one fragment),
/// in `outer_wire` form: `start()` launches it over the values they hold, `finish()` waits and
/// leaves the average in them. The tensors must not be touched in between.
class outer_exchange {
 public:
  /// Averages `grads` (host, floating point; the caller checked) over `comm`; `caller` names
  /// the operation in errors.
  outer_exchange(communicator_ref comm, std::vector<tensor_view> grads, outer_wire wire, const char* caller)
      : comm_(comm), grads_(std::move(grads)), wire_(wire), caller_(caller) {
    for (const tensor_view& g : grads_) total_ += g.count;
  }

  /// True between `start()` and `finish()`.
  [[nodiscard]] bool in_flight() const noexcept { return in_flight_; }

  /// Launches the average of the values the tensors hold now, divided by `divisor` (the ranks
  /// that contribute; 0: every rank). A rank that does not contribute holds zeros.
  void start(int divisor = 0) {
    const int n = divisor > 0 ? divisor : comm_.size();
    divisor_ = n;
    in_flight_ = true;
    switch (wire_) {
      case outer_wire::native: pending_ = allreduce_average(comm_, grads_, n, average_input::raw, caller_); break;
      case outer_wire::bf16: start_bf16(n); break;
      case outer_wire::int8: start_int8(); break;
    }
  }

  /// Drives the exchange forward (Open MPI moves only when asked); true once it completed.
  bool test() { return pending_.test(); }

  /// Waits for the exchange; the tensors then hold the average, the same bits on every rank.
  void finish() {
    in_flight_ = false;
    pending_.wait();
    if (wire_ == outer_wire::bf16) {
      std::size_t off = 0;
      for (const tensor_view& g : grads_) {
        convert(dtype::bf16, wire_bytes_.data() + off * 2, g.type, g.data, g.count);
        off += g.count;
      }
    } else if (wire_ == outer_wire::int8) {
      finish_int8();
    }
  }

 private:
  void start_bf16(int n) {
    wire_bytes_.resize(total_ * 2);
    std::size_t off = 0;
    for (const tensor_view& g : grads_) {
      // Divide in the wide type before narrowing (ddp/average.hpp): the narrow sum cannot overflow.
      average_divide_in_place(g.type, g.data, g.count, n);
      convert(g.type, g.data, dtype::bf16, wire_bytes_.data() + off * 2, g.count);
      off += g.count;
    }
    const tensor_view wire{wire_bytes_.data(), total_, dtype::bf16, device::host()};
    pending_ = allreduce_average(comm_, wire, n, average_input::divided, caller_);
  }

  // Each rank's block: one f32 scale per tensor, then its values as i8.
  [[nodiscard]] std::size_t block_bytes() const noexcept { return grads_.size() * sizeof(float) + total_; }

  void start_int8() {
    wire_bytes_.assign(block_bytes(), std::byte{0});
    std::byte* q = wire_bytes_.data() + grads_.size() * sizeof(float);
    for (std::size_t t = 0; t < grads_.size(); ++t) {
      const tensor_view& g = grads_[t];
      visit_dtype(g.type, [&]<class T>(T) {
        const T* x = static_cast<const T*>(g.data);
        double amax = 0;
        for (std::size_t i = 0; i < g.count; ++i) amax = std::max(amax, std::abs(static_cast<double>(load(x[i]))));
        if (std::isnan(amax)) amax = std::numeric_limits<double>::infinity();
        // A non-finite scale travels as NaN and poisons the average on every rank alike.
        const float scale =
            std::isfinite(amax) ? static_cast<float>(amax / 127) : std::numeric_limits<float>::quiet_NaN();
        std::memcpy(wire_bytes_.data() + t * sizeof(float), &scale, sizeof scale);
        for (std::size_t i = 0; i < g.count; ++i) {
          double v = scale > 0 ? std::nearbyint(static_cast<double>(load(x[i])) / scale) : 0.0;
          v = std::clamp(v, -127.0, 127.0);
          q[i] = static_cast<std::byte>(static_cast<std::int8_t>(v));
        }
        q += g.count;
      });
    }
    const std::size_t n = static_cast<std::size_t>(comm_.size());
    gathered_.assign(block_bytes() * n, std::byte{0});
    pending_ = comm_.allgather(tensor_view{wire_bytes_.data(), block_bytes(), dtype::i8, device::host()},
                               tensor_view{gathered_.data(), gathered_.size(), dtype::i8, device::host()});
  }

  void finish_int8() {
    const std::size_t n = gathered_.size() / block_bytes();
    const double inv = 1.0 / static_cast<double>(divisor_);
    std::size_t off = 0;
    for (std::size_t t = 0; t < grads_.size(); ++t) {
      const tensor_view& g = grads_[t];
      std::vector<double> scales(n);
      for (std::size_t r = 0; r < n; ++r) {
        float s = 0;
        std::memcpy(&s, gathered_.data() + r * block_bytes() + t * sizeof(float), sizeof s);
        scales[r] = s;
      }
      visit_dtype(g.type, [&]<class T>(T) {
        T* x = static_cast<T*>(g.data);
        for (std::size_t i = 0; i < g.count; ++i) {
          double acc = 0;
          for (std::size_t r = 0; r < n; ++r) {
            const auto q =
                static_cast<std::int8_t>(gathered_[r * block_bytes() + grads_.size() * sizeof(float) + off + i]);
            acc += static_cast<double>(q) * scales[r];
          }
          x[i] = store<T>(static_cast<compute_t<T>>(acc * inv));
        }
      });
      off += g.count;
    }
  }

  communicator_ref comm_;
  std::vector<tensor_view> grads_;
  outer_wire wire_;
  const char* caller_;
  std::size_t total_ = 0;
  int divisor_ = 1;
  bool in_flight_ = false;
  work pending_;
  std::vector<std::byte> wire_bytes_;  // bf16 values, or this rank's int8 block
  std::vector<std::byte> gathered_;    // int8: every rank's block, in rank order
};

}  // namespace detail

}  // namespace ddp
