#pragma once
/// @file bucketer/gradients.hpp
/// @brief The Bucketer's registered gradients: `detail::bucketer_gradients`, which keeps each
/// gradient's source (to follow one that moves), its parameter and name, and names gradients in
/// errors. Not for users.

#include <concepts>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/bucket_layout.hpp>
#include <ddp/communicator.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>

namespace ddp::detail {

/// One registered gradient.
struct bucketer_entry {
  std::optional<tensor_view> parameter;
  tensor_view gradient;  ///< as last read: the copy paths follow a gradient that moved
  std::size_t bucket = 0;
  std::size_t offset = 0;              ///< elements into the bucket
  detail::tensor_source param_source;  ///< a held handle, re-read by broadcast_parameters
  detail::tensor_source grad_source;   ///< the trainer's slot (or a held handle), re-read by mark_ready
  std::string name;                    ///< for errors (optional)
};

/// The registered gradients of a Bucketer and the checks on them; a base of `bucketer_engine`.
class bucketer_gradients {
 protected:
  explicit bucketer_gradients(communicator_ref comm) : comm_(comm) {}
  ~bucketer_gradients() = default;
  bucketer_gradients(const bucketer_gradients&) = delete;
  bucketer_gradients& operator=(const bucketer_gradients&) = delete;

  // A registered argument of type T&& can be kept without dangling: an lvalue (referred to), a
  // handle (copied) or a view.
  template <class T>
  static constexpr bool kept_safely =
      std::is_lvalue_reference_v<T> || is_tensor_handle_v<T> || std::same_as<std::remove_cvref_t<T>, tensor_view>;

  // How gradient `g` (passed as G&&) is re-read: see Bucketer::add(G&&).
  template <class G>
  static tensor_source gradient_source(G&& g) {
    using D = std::remove_cvref_t<G>;
    if constexpr (std::same_as<D, tensor_view>) {
      return {};
    } else if constexpr (std::is_lvalue_reference_v<G>) {
      return tensor_source::referring_to(g);  // the slot: sees a replaced gradient
    } else {
      return tensor_source::holding(D(std::forward<G>(g)));
    }
  }

  void check_pair(tensor_view parameter, tensor_view gradient, std::string_view name) const {
    if (parameter.count != gradient.count || parameter.type != gradient.type) {
      throw usage_error(comm_.rank(), "Bucketer::add",
                        "parameter " + label_of(entries_.size(), name) + " has " + std::to_string(parameter.count) +
                            " " + std::string(name_of(parameter.type)) + " elements but its gradient has " +
                            std::to_string(gradient.count) + " " + std::string(name_of(gradient.type)));
    }
  }

  // Registers a gradient; `device_problem` is why its device does not suit the communicator ("": it does).
  std::size_t add_entry(std::optional<tensor_view> param, tensor_view grad, tensor_source param_source,
                        tensor_source grad_source, std::string_view name, bool built,
                        const std::string& device_problem) {
    const std::size_t i = entries_.size();
    const std::string who = "gradient " + label_of(i, name);
    if (built) throw usage_error(comm_.rank(), "Bucketer::add", who + " added after build()");
    if (!device_problem.empty()) throw usage_error(comm_.rank(), "Bucketer::add", who + " " + device_problem);
    if (grad.count > 0 && grad.data == nullptr) {
      throw usage_error(comm_.rank(), "Bucketer::add", who + " has no data pointer");
    }
    for (std::size_t j = 0; j < entries_.size(); ++j) {  // empty gradients own no memory: they may share an address
      const tensor_view& other = entries_[j].gradient;
      if (grad.count > 0 && other.count > 0 && grad.byte_data() < other.byte_data() + other.bytes() &&
          other.byte_data() < grad.byte_data() + grad.bytes()) {
        throw usage_error(
            comm_.rank(), "Bucketer::add",
            who + (grad.data == other.data ? " is the same memory as" : " overlaps the memory of") + " " + label(j));
      }
    }
    entries_.push_back({param, grad, 0, 0, std::move(param_source), std::move(grad_source), std::string(name)});
    return i;
  }

  // Gradient `i`'s current view from its source; follows it if it moved (copy paths).
  // @throws usage_error if its element count, dtype or device changed
  void follow_gradient(std::size_t i, bucketer_entry& e, const char* op) const {
    const tensor_view now = read_gradient(i, e, op);
    if (now.data == e.gradient.data && now.count == e.gradient.count && now.type == e.gradient.type &&
        now.where == e.gradient.where) {
      return;  // the usual case: nothing moved
    }
    if (!same_shape(now, e.gradient)) throw_reshaped(i, e.gradient, now, op);
    e.gradient.data = now.data;
  }

  static bool same_shape(const tensor_view& a, const tensor_view& b) noexcept {
    return a.count == b.count && a.type == b.type && a.where == b.where && (a.count == 0 || a.data != nullptr);
  }

  [[noreturn]] void throw_reshaped(std::size_t i, const tensor_view& was, const tensor_view& now,
                                   const char* op) const {
    throw usage_error(comm_.rank(), op,
                      label(i) + " was registered as " + std::string(name_of(was.type)) + " x " +
                          std::to_string(was.count) + " on " + was.where.str() + " and is now " +
                          std::string(name_of(now.type)) + " x " + std::to_string(now.count) + " on " +
                          now.where.str() + (now.count > 0 && now.data == nullptr ? " without memory" : "") +
                          ": a gradient may move to new memory (the Bucketer follows it), but its element count, "
                          "dtype and device must stay; a gradient set to None (zero_grad(set_to_none=true)) must be "
                          "computed again, or zeroed, before it is marked ready");
  }

  [[noreturn]] void throw_lost(const std::vector<std::size_t>& lost) const {
    throw usage_error(comm_.rank(), "Bucketer::finalize",
                      "gradients " + labels(lost) +
                          " were not computed on this rank and no longer have their registered element count, dtype "
                          "and memory (set to None?), but other ranks used them, so this rank cannot receive their "
                          "average; zero such gradients instead of setting them to None");
  }

  [[noreturn]] void throw_unmarked(const std::vector<std::size_t>& unmarked) const {
    throw usage_error(comm_.rank(), "Bucketer::finalize",
                      std::to_string(unmarked.size()) + " of " + std::to_string(entries_.size()) +
                          " gradients were never marked ready (indices " + labels(unmarked) +
                          "); if some parameters go unused in some iterations, set find_unused_parameters");
  }

  // "3" or "3 ('fc.bias')": how errors name a gradient.
  [[nodiscard]] static std::string label_of(std::size_t i, std::string_view name) {
    std::string out = std::to_string(i);
    if (!name.empty()) out.append(" ('").append(name).append("')");
    return out;
  }
  [[nodiscard]] std::string label(std::size_t i) const {
    return "gradient " + label_of(i, i < entries_.size() ? std::string_view(entries_[i].name) : std::string_view());
  }
  // The first ten of `indices`, labelled.
  [[nodiscard]] std::string labels(const std::vector<std::size_t>& indices) const {
    std::string list;
    for (std::size_t k = 0; k < indices.size() && k < 10; ++k) {
      list += (k ? ", " : "") + label_of(indices[k], entries_[indices[k]].name);
    }
    if (indices.size() > 10) list += ", ...";
    return list;
  }
  // Gradient i's current view from its source, with this rank and its name in an error the
  // tensor type raised (which knows neither).
  [[nodiscard]] tensor_view read_gradient(std::size_t i, const bucketer_entry& e, const char* op) const {
    try {
      return e.grad_source.read();
    } catch (const error& x) {
      if (x.rank() >= 0) throw;
      throw usage_error(comm_.rank(), op, label(i) + ": " + x.message());
    }
  }

  [[nodiscard]] std::vector<gradient_info> infos() const {
    std::vector<gradient_info> out;
    out.reserve(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      out.push_back({i, entries_[i].gradient.count, entries_[i].gradient.type, entries_[i].gradient.where});
    }
    return out;
  }

  // Broadcasts every registered parameter from `root` (one coalesced collective); a parameter
  // held as a handle is re-read first. See Bucketer::broadcast_parameters.
  void broadcast_parameters_from(int root) {
    std::vector<tensor_view> params;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      bucketer_entry& e = entries_[i];
      if (!e.parameter) continue;
      if (e.param_source.rereads()) {
        const tensor_view now = e.param_source.read();
        if (!same_shape(now, *e.parameter)) {
          throw usage_error(comm_.rank(), "Bucketer::broadcast_parameters",
                            "parameter " + label_of(i, e.name) + " was registered as " +
                                std::string(name_of(e.parameter->type)) + " x " + std::to_string(e.parameter->count) +
                                " and is now " + std::string(name_of(now.type)) + " x " + std::to_string(now.count));
        }
        e.parameter = now;
      }
      params.push_back(*e.parameter);
    }
    if (params.empty()) return;
    comm_.broadcast(params, root).wait();
  }

  communicator_ref comm_;
  std::vector<bucketer_entry> entries_;
};

}  // namespace ddp::detail
