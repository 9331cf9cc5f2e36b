#pragma once
// Backend-generic collective checks, written once and run over every backend (local threads,
// MPI processes, gloo processes). They throw `suite_failure` instead of using Catch assertions
// because the local backend runs them on several threads, where Catch2 v2 is not safe.

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>

namespace suite {

struct suite_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define SUITE_EXPECT(cond, msg)                                              \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::ostringstream os_;                                                \
      os_ << __FILE__ << ":" << __LINE__ << ": expected " #cond ": " << msg; \
      throw ::suite::suite_failure(os_.str());                               \
    }                                                                        \
  } while (0)

inline const std::vector<ddp::dtype>& all_dtypes() {
  static const std::vector<ddp::dtype> v(ddp::all_dtypes.begin(), ddp::all_dtypes.end());
  return v;
}
inline const std::vector<ddp::reduce_op>& all_ops() {
  static const std::vector<ddp::reduce_op> v{ddp::reduce_op::sum, ddp::reduce_op::avg, ddp::reduce_op::min,
                                             ddp::reduce_op::max, ddp::reduce_op::prod};
  return v;
}

/// Rank r's element i: small positive integers, exact in every dtype, products fit in i8 for 4 ranks.
inline double value(int r, std::size_t i) { return static_cast<double>((static_cast<std::size_t>(r) + i) % 3 + 1); }

/// A host buffer of `n` elements of dtype `t`, filled from doubles.
struct buffer {
  ddp::dtype type;
  std::vector<std::byte> bytes;
  buffer(ddp::dtype t, std::size_t n) : type(t), bytes(n * ddp::size_of(t)) {}
  std::size_t count() const { return bytes.size() / ddp::size_of(type); }
  ddp::tensor_view view() { return {bytes.data(), count(), type, ddp::device::host()}; }
  void set(std::size_t i, double v) {
    ddp::detail::convert(ddp::dtype::f64, &v, type, bytes.data() + i * ddp::size_of(type), 1);
  }
  double get(std::size_t i) const {
    double v = 0;
    ddp::detail::convert(type, bytes.data() + i * ddp::size_of(type), ddp::dtype::f64, &v, 1);
    return v;
  }
};

inline double expected_reduction(ddp::reduce_op op, ddp::dtype t, int size, std::size_t i) {
  double acc = value(0, i);
  for (int r = 1; r < size; ++r) {
    const double v = value(r, i);
    switch (op) {
      case ddp::reduce_op::sum:
      case ddp::reduce_op::avg: acc += v; break;
      case ddp::reduce_op::prod: acc *= v; break;
      case ddp::reduce_op::min: acc = std::min(acc, v); break;
      case ddp::reduce_op::max: acc = std::max(acc, v); break;
    }
  }
  if (op == ddp::reduce_op::avg) {
    acc = ddp::is_floating(t) ? acc / size : std::trunc(acc / size);
  }
  return acc;
}

inline double tolerance(ddp::dtype t) {
  switch (t) {
    case ddp::dtype::f16:
    case ddp::dtype::bf16: return 1e-2;
    case ddp::dtype::f32: return 1e-6;
    case ddp::dtype::f64: return 1e-12;
    default: return 0.0;
  }
}

/// Checks got ~ want; `where` (a string, or a callable returning one, built only on failure:
/// the suites check millions of elements) says which element.
template <class Where>
void expect_close(double got, double want, ddp::dtype t, const Where& where) {
  const double tol = tolerance(t);
  if (std::abs(got - want) <= tol * std::max(1.0, std::abs(want))) return;
  std::string place;
  if constexpr (std::is_invocable_v<const Where&>) {
    place = where();
  } else {
    place = where;
  }
  SUITE_EXPECT(false, place << ": got " << got << ", want " << want << " (" << ddp::name_of(t) << ")");
}

/// Every rank must hold the same bytes: allgather them and compare.
inline void expect_same_bits_everywhere(ddp::communicator_ref comm, const buffer& b, const std::string& where) {
  std::vector<std::uint8_t> mine(b.bytes.size());
  if (mine.empty()) return;  // nothing to compare (and memcpy/memcmp take no null pointers)
  std::memcpy(mine.data(), b.bytes.data(), mine.size());
  std::vector<std::uint8_t> all(mine.size() * static_cast<std::size_t>(comm.size()));
  comm.allgather(ddp::view(mine), ddp::view(all)).wait();
  for (int r = 0; r < comm.size(); ++r) {
    SUITE_EXPECT(std::memcmp(all.data() + static_cast<std::size_t>(r) * mine.size(), mine.data(), mine.size()) == 0,
                 where << ": rank " << r << " holds different bits from rank " << comm.rank());
  }
}

inline void allreduce_every_op_and_dtype(ddp::communicator_ref comm, const std::vector<std::size_t>& sizes) {
  for (ddp::dtype t : all_dtypes()) {
    for (ddp::reduce_op op : all_ops()) {
      for (std::size_t n : sizes) {
        buffer b(t, n);
        for (std::size_t i = 0; i < n; ++i) b.set(i, value(comm.rank(), i));
        const auto v = b.view();
        comm.allreduce(std::span<const ddp::tensor_view>(&v, 1), op).wait();
        const std::string where = std::string("allreduce ") + std::string(ddp::name_of(op)) + " " +
                                  std::string(ddp::name_of(t)) + " n=" + std::to_string(n);
        for (std::size_t i = 0; i < n; ++i) {
          expect_close(b.get(i), expected_reduction(op, t, comm.size(), i), t,
                       [&] { return std::string(where + " i=" + std::to_string(i)); });
        }
        expect_same_bits_everywhere(comm, b, where);
      }
    }
  }
}

inline void allreduce_coalesced_mixed_dtypes(ddp::communicator_ref comm) {
  std::vector<buffer> bufs;
  std::size_t n = 1;
  for (ddp::dtype t : all_dtypes()) {
    bufs.emplace_back(t, n);
    for (std::size_t i = 0; i < n; ++i) bufs.back().set(i, value(comm.rank(), i));
    n = n * 3 + 2;
  }
  bufs.emplace_back(ddp::dtype::f32, 0);  // an empty tensor among them
  std::vector<ddp::tensor_view> views;
  for (auto& b : bufs) views.push_back(b.view());
  comm.allreduce(views, ddp::reduce_op::sum).wait();
  for (auto& b : bufs) {
    for (std::size_t i = 0; i < b.count(); ++i) {
      expect_close(b.get(i), expected_reduction(ddp::reduce_op::sum, b.type, comm.size(), i), b.type,
                   [&] { return std::string("coalesced allreduce " + std::string(ddp::name_of(b.type))); });
    }
  }
}

inline void broadcast_from_every_root(ddp::communicator_ref comm) {
  for (int root = 0; root < comm.size(); ++root) {
    std::vector<buffer> bufs;
    for (ddp::dtype t : {ddp::dtype::f32, ddp::dtype::i64, ddp::dtype::bf16, ddp::dtype::u8}) {
      bufs.emplace_back(t, 1001);
      for (std::size_t i = 0; i < 1001; ++i) bufs.back().set(i, value(comm.rank(), i) + 10 * comm.rank());
    }
    std::vector<ddp::tensor_view> views;
    for (auto& b : bufs) views.push_back(b.view());
    comm.broadcast(views, root).wait();
    for (auto& b : bufs) {
      for (std::size_t i = 0; i < b.count(); ++i) {
        expect_close(b.get(i), value(root, i) + 10 * root, b.type,
                     [&] { return std::string("broadcast root " + std::to_string(root)); });
      }
    }
  }
}

inline void allgather_and_reduce_scatter(ddp::communicator_ref comm) {
  const auto size = static_cast<std::size_t>(comm.size());
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{4099}}) {
    std::vector<std::int32_t> in(n);
    for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<std::int32_t>(comm.rank() * 100000 + static_cast<int>(i));
    std::vector<std::int32_t> out(n * size, -1);
    comm.allgather(ddp::view(in), ddp::view(out)).wait();
    for (std::size_t r = 0; r < size; ++r) {
      for (std::size_t i = 0; i < n; ++i) {
        SUITE_EXPECT(out[r * n + i] == static_cast<std::int32_t>(r * 100000 + i), "allgather n=" << n << " r=" << r);
      }
    }
    std::vector<double> rin(n * size);
    for (std::size_t i = 0; i < rin.size(); ++i) rin[i] = value(comm.rank(), i);
    std::vector<double> rout(n, -1.0);
    comm.reduce_scatter(ddp::view(rin), ddp::view(rout), ddp::reduce_op::sum).wait();
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t gi = static_cast<std::size_t>(comm.rank()) * n + i;
      expect_close(rout[i], expected_reduction(ddp::reduce_op::sum, ddp::dtype::f64, comm.size(), gi), ddp::dtype::f64,
                   [&] { return std::string("reduce_scatter n=" + std::to_string(n)); });
    }
    // The in-place form (backend_contract.hpp): the input is this rank's block of the output.
    std::vector<std::int32_t> all(n * size, -1);
    for (std::size_t i = 0; i < n; ++i) all[static_cast<std::size_t>(comm.rank()) * n + i] = in[i];
    const ddp::tensor_view mine = ddp::view(all).slice(static_cast<std::size_t>(comm.rank()) * n, n);
    comm.allgather(mine, ddp::view(all)).wait();
    SUITE_EXPECT(all == out, "in-place allgather n=" << n << " differs from the out-of-place one");
  }
}

inline void barrier_and_many_in_flight(ddp::communicator_ref comm) {
  comm.barrier().wait();
  // Many outstanding operations, completed out of issue order.
  std::vector<std::vector<float>> bufs(16, std::vector<float>(257));
  std::vector<ddp::work> works;
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    for (auto& x : bufs[k]) x = static_cast<float>(comm.rank() + static_cast<int>(k));
    works.push_back(comm.allreduce(bufs[k], ddp::reduce_op::sum));
  }
  for (std::size_t k = works.size(); k-- > 0;) works[k].wait();
  const int size = comm.size();
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    const float want = static_cast<float>(size * (size - 1) / 2 + size * static_cast<int>(k));
    for (float x : bufs[k]) SUITE_EXPECT(x == want, "in-flight allreduce " << k << ": " << x << " != " << want);
  }
}

inline void large_allreduce(ddp::communicator_ref comm) {
  const std::size_t n = (64u << 20) / 4 + 12345;  // > 64 MiB of f32
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(value(comm.rank(), i));
  comm.allreduce(v, ddp::reduce_op::sum).wait();
  for (std::size_t i = 0; i < n; i += 4093) {
    SUITE_EXPECT(v[i] == static_cast<float>(expected_reduction(ddp::reduce_op::sum, ddp::dtype::f32, comm.size(), i)),
                 "large allreduce at " << i);
  }
  SUITE_EXPECT(
      v[n - 1] == static_cast<float>(expected_reduction(ddp::reduce_op::sum, ddp::dtype::f32, comm.size(), n - 1)),
      "large allreduce last element");
}

/// `call()` must throw a usage_error on this rank, naming the rank, the collective (`op`, in the
/// error's operation) and every one of `fragments` (in its text).
template <class Call>
void expect_usage_error(ddp::communicator_ref comm, const std::string& what, Call&& call, const std::string& op,
                        std::initializer_list<std::string> fragments) {
  std::string got = "no exception";
  try {
    call().wait();
  } catch (const ddp::usage_error& e) {
    got = e.what();
    bool ok = e.rank() == comm.rank() && e.operation().find(op) != std::string::npos &&
              got.find("rank " + std::to_string(comm.rank())) != std::string::npos;
    for (const auto& f : fragments) ok = ok && got.find(f) != std::string::npos;
    if (ok) return;
  } catch (const std::exception& e) {
    got = std::string("another exception: ") + e.what();
  }
  std::string want;
  for (const auto& f : fragments) want += " \"" + f + "\"";
  SUITE_EXPECT(false, what << ": want a usage_error on rank " << comm.rank() << " in " << op << " saying" << want
                           << "; got: " << got);
}

/// Errors every backend must detect locally, before communicating: the checks of
/// backend_contract.hpp, with its messages. A refused call takes no sequence number, so the
/// collectives after it still match across ranks (checked at the end).
inline void usage_errors(ddp::communicator_ref comm) {
  const auto size = static_cast<std::size_t>(comm.size());
  const std::string n_ranks = std::to_string(comm.size());
  std::vector<float> host(8);
  ddp::tensor_view on_device = ddp::view(host);
  on_device.where = ddp::device::cuda(0);
  expect_usage_error(
      comm, "device memory handed to a host backend",
      [&] { return comm.allreduce(std::span<const ddp::tensor_view>(&on_device, 1), ddp::reduce_op::sum); },
      "allreduce", {"needs host memory", "got a tensor on cuda:0"});

  const std::array<ddp::tensor_view, 2> second_on_device{ddp::view(host), on_device};
  expect_usage_error(comm, "device memory as the second tensor of a coalesced call",
                     [&] { return comm.allreduce(second_on_device, ddp::reduce_op::sum); }, "allreduce",
                     {"got a tensor on cuda:0 (tensor #1 of 2)"});

  const std::array<ddp::tensor_view, 2> second_without_data{ddp::view(host),
                                                            ddp::tensor_view{nullptr, 4, ddp::dtype::f32, {}}};
  expect_usage_error(comm, "a tensor with elements but no data pointer",
                     [&] { return comm.broadcast(second_without_data, 0); }, "broadcast",
                     {"tensor #1 of 2 has 4 elements but no data pointer"});

  expect_usage_error(comm, "a broadcast root that is not a rank", [&] { return comm.broadcast(host, comm.size()); },
                     "broadcast", {"root " + n_ranks + " is not a rank of a communicator of size " + n_ranks});

  std::vector<float> small(3), big(3 * size + 2);
  expect_usage_error(comm, "allgather with a wrong output size",
                     [&] { return comm.allgather(ddp::view(small), ddp::view(big)); }, "allgather",
                     {"output has " + std::to_string(big.size()) + " elements, expected " + std::to_string(3 * size) +
                      " (input count 3 x size " + n_ranks + ")"});
  expect_usage_error(comm, "reduce_scatter with a wrong input size",
                     [&] { return comm.reduce_scatter(ddp::view(big), ddp::view(small), ddp::reduce_op::sum); },
                     "reduce_scatter",
                     {"input has " + std::to_string(big.size()) + " elements, expected " + std::to_string(3 * size) +
                      " (output count 3 x size " + n_ranks + ")"});

  std::vector<double> wide(3 * size);
  expect_usage_error(comm, "allgather between dtypes",
                     [&] { return comm.allgather(ddp::view(small), ddp::view(wide)); }, "allgather",
                     {"input dtype f32 differs from output dtype f64"});

  // Overlaps: an allgather's input may only be this rank's own block of the output; a
  // reduce_scatter's input and output may not overlap at all.
  std::vector<float> shared(4 * size + 4);
  const ddp::tensor_view whole = ddp::view(shared).slice(0, 4 * size);
  const ddp::tensor_view off_block = ddp::view(shared).slice(static_cast<std::size_t>(comm.rank()) * 4 + 1, 4);
  expect_usage_error(comm, "allgather whose input overlaps the output off its block",
                     [&] { return comm.allgather(off_block, whole); }, "allgather", {"input overlaps output"});
  const ddp::tensor_view tail = ddp::view(shared).slice(4 * size - 2, 4);
  expect_usage_error(comm, "reduce_scatter with overlapping input and output",
                     [&] { return comm.reduce_scatter(whole, tail, ddp::reduce_op::sum); }, "reduce_scatter",
                     {"input and output overlap"});

  // None of the refused calls was issued: the next collective matches on every rank.
  std::vector<std::int64_t> one{1};
  comm.allreduce(one, ddp::reduce_op::sum).wait();
  SUITE_EXPECT(one[0] == comm.size(), "allreduce after refused calls: got " << one[0] << ", want " << comm.size());
}

/// Runs everything except the large case.
inline void run_all(ddp::communicator_ref comm) {
  allreduce_every_op_and_dtype(comm, {0, 1, 7, 1000, (1u << 16) + 3});
  allreduce_coalesced_mixed_dtypes(comm);
  broadcast_from_every_root(comm);
  allgather_and_reduce_scatter(comm);
  barrier_and_many_in_flight(comm);
  usage_errors(comm);
}

// --- appended by the MPI backend work --------------------------------------------------------

/// Coalesced allreduce with several tensors per dtype, interleaved (backends that stage each
/// dtype group copy them in and out), for every op; `big` elements make one group large.
inline void allreduce_coalesced_groups(ddp::communicator_ref comm, std::size_t big) {
  const std::vector<ddp::dtype> types{ddp::dtype::f32,  ddp::dtype::i64, ddp::dtype::f16, ddp::dtype::f32,
                                      ddp::dtype::bf16, ddp::dtype::i64, ddp::dtype::f16, ddp::dtype::bf16,
                                      ddp::dtype::u8,   ddp::dtype::f32};
  for (ddp::reduce_op op : all_ops()) {
    std::vector<buffer> bufs;
    for (std::size_t k = 0; k < types.size(); ++k) {
      const std::size_t n = k == 3 ? big : 5 + 7 * k;
      bufs.emplace_back(types[k], n);
      for (std::size_t i = 0; i < n; ++i) bufs.back().set(i, value(comm.rank(), i + k));
    }
    bufs.emplace_back(ddp::dtype::i64, 0);
    std::vector<ddp::tensor_view> views;
    for (auto& b : bufs) views.push_back(b.view());
    comm.allreduce(views, op).wait();
    for (std::size_t k = 0; k < types.size(); ++k) {
      const buffer& b = bufs[k];
      const std::string where = "coalesced groups " + std::string(ddp::name_of(op)) + " tensor " + std::to_string(k) +
                                " (" + std::string(ddp::name_of(b.type)) + ")";
      for (std::size_t i = 0; i < b.count(); ++i) {
        double want = expected_reduction(op, b.type, comm.size(), i + k);
        expect_close(b.get(i), want, b.type, [&] { return std::string(where + " i=" + std::to_string(i)); });
      }
      expect_same_bits_everywhere(comm, b, where);
    }
  }
}

/// Several large allreduces in flight at once, completed in reverse order (backends that
/// implement large allreduces over point-to-point messages must keep them apart).
inline void large_allreduces_in_flight(ddp::communicator_ref comm, std::size_t n) {
  std::vector<std::vector<float>> bufs(4, std::vector<float>(n));
  std::vector<ddp::work> works;
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    for (std::size_t i = 0; i < n; ++i)
      bufs[k][i] = static_cast<float>(value(comm.rank(), i + k) + static_cast<double>(k));
    works.push_back(comm.allreduce(bufs[k], k % 2 ? ddp::reduce_op::avg : ddp::reduce_op::sum));
  }
  for (std::size_t k = works.size(); k-- > 0;) works[k].wait();
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    for (std::size_t i = 0; i < n; i += 97) {
      double want = 0;
      for (int r = 0; r < comm.size(); ++r) want += value(r, i + k) + static_cast<double>(k);
      if (k % 2) want /= comm.size();
      expect_close(bufs[k][i], want, ddp::dtype::f32,
                   [&] { return std::string("large in flight " + std::to_string(k) + " i=" + std::to_string(i)); });
    }
  }
}

}  // namespace suite
