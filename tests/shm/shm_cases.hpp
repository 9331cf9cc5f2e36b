#pragma once
// Checks of the shared-memory allreduce that go beyond the backend-generic suite: every dtype
// and operator at the size classes that stress the pipeline (0, 1, 7, not divisible by the rank
// count, around and above the chunk size), with non-integer values checked against a
// double-precision reference and bit equality across ranks. Backend-generic: they run over any
// communicator_ref (MPI processes or local threads), so they throw suite_failure.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>

#include "../common/collective_suite.hpp"

namespace shm_cases {

/// Node labels of two simulated nodes, first half / second half: {0,1}, {0,0,1}, {0,0,1,1}.
inline std::vector<int> halves(int n) {
  std::vector<int> v(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) v[static_cast<std::size_t>(r)] = r < (n + 1) / 2 ? 0 : 1;
  return v;
}

/// Size classes for a communicator whose chunk holds `chunk_elems` elements of the widest dtype.
inline std::vector<std::size_t> size_classes(int ranks, std::size_t chunk_elems) {
  const auto r = static_cast<std::size_t>(ranks);
  return {0, 1, 7, 3 * r + 1, 1000 * r + r - 1, chunk_elems - 1, chunk_elems + 13, 5 * chunk_elems + 7 * r + 3};
}

/// A deterministic value in [-1, 1) for (rank, element), not exactly representable in the
/// 2-byte floats, so rounding paths are exercised. Integers get small values whose products
/// over 6 ranks fit in their type.
inline double value(ddp::dtype t, int rank, std::size_t i) {
  std::uint64_t x = (static_cast<std::uint64_t>(rank) + 1) * 0x9e3779b97f4a7c15ull ^ (i + 1) * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  if (!ddp::is_floating(t)) {
    if (t == ddp::dtype::u8) return static_cast<double>(x % 3);                        // 0..2
    if (t == ddp::dtype::i8) return static_cast<double>(static_cast<int>(x % 5) - 2);  // -2..2
    return static_cast<double>(static_cast<int>(x % 7) - 3);                           // -3..3
  }
  return static_cast<double>(x >> 11) * 0x1p-52 - 1.0;
}

/// The value as stored in dtype t.
inline double stored(ddp::dtype t, double v) {
  std::uint64_t raw = 0;
  ddp::detail::convert(ddp::dtype::f64, &v, t, &raw, 1);
  double back = 0;
  ddp::detail::convert(t, &raw, ddp::dtype::f64, &back, 1);
  return back;
}

/// Relative accuracy of one rounding in dtype t.
inline double unit_roundoff(ddp::dtype t) {
  switch (t) {
    case ddp::dtype::f16: return 0x1p-11;
    case ddp::dtype::bf16: return 0x1p-8;
    case ddp::dtype::f32: return 0x1p-24;
    case ddp::dtype::f64: return 0x1p-53;
    default: return 0;
  }
}

/// Checks one allreduce of n elements of dtype t with op over `comm` against a double reference
/// and across ranks.
/// `levels`: 1 for a flat reduction, 2 when partial results are rounded to the dtype on the way
/// (hierarchical: once per node, then across nodes).
inline void check_allreduce(ddp::communicator_ref comm, ddp::dtype t, ddp::reduce_op op, std::size_t n,
                            const std::string& label, int levels = 1) {
  const int size = comm.size();
  const std::size_t width = ddp::size_of(t);
  // Block-wise, one dtype dispatch per block: per-element conversions made the reference, not the
  // allreduce, most of these tests' time (64 MiB cases).
  constexpr std::size_t block = std::size_t{1} << 15;
  std::vector<double> x(block), ref(block), magnitude(block), got(block);
  std::vector<std::byte> raw(block * sizeof(double));
  // Rank r's values of elements [start, start + m) as stored in dtype t, into x.
  const auto stored_values = [&](int r, std::size_t start, std::size_t m) {
    for (std::size_t i = 0; i < m; ++i) x[i] = value(t, r, start + i);
    ddp::detail::convert(ddp::dtype::f64, x.data(), t, raw.data(), m);
    ddp::detail::convert(t, raw.data(), ddp::dtype::f64, x.data(), m);
  };
  suite::buffer b(t, n);
  for (std::size_t start = 0; start < n; start += block) {
    const std::size_t m = std::min(block, n - start);
    for (std::size_t i = 0; i < m; ++i) x[i] = value(t, comm.rank(), start + i);
    ddp::detail::convert(ddp::dtype::f64, x.data(), t, b.bytes.data() + start * width, m);
  }
  const auto v = b.view();
  comm.allreduce(std::span<const ddp::tensor_view>(&v, 1), op).wait();
  const std::string where = label + " allreduce " + std::string(ddp::name_of(op)) + " " + std::string(ddp::name_of(t)) +
                            " n=" + std::to_string(n);
  // Half types accumulate in f32 and round once per level (two levels when hierarchical).
  const double u = unit_roundoff(t);
  const bool narrow = t == ddp::dtype::f16 || t == ddp::dtype::bf16;
  const double acc_u = narrow && levels == 1 ? 0x1p-24 : u;
  for (std::size_t start = 0; start < n; start += block) {
    const std::size_t m = std::min(block, n - start);
    stored_values(0, start, m);
    for (std::size_t i = 0; i < m; ++i) {
      ref[i] = x[i];
      magnitude[i] = std::abs(x[i]);
    }
    for (int r = 1; r < size; ++r) {
      stored_values(r, start, m);
      for (std::size_t i = 0; i < m; ++i) {
        magnitude[i] += std::abs(x[i]);
        switch (op) {
          case ddp::reduce_op::sum:
          case ddp::reduce_op::avg: ref[i] += x[i]; break;
          case ddp::reduce_op::prod:
            ref[i] *= x[i];
            magnitude[i] = std::abs(ref[i]);
            break;
          case ddp::reduce_op::min:
            ref[i] = std::min(ref[i], x[i]);
            magnitude[i] = std::abs(ref[i]);
            break;
          case ddp::reduce_op::max:
            ref[i] = std::max(ref[i], x[i]);
            magnitude[i] = std::abs(ref[i]);
            break;
        }
      }
    }
    ddp::detail::convert(t, b.bytes.data() + start * width, ddp::dtype::f64, got.data(), m);
    for (std::size_t i = 0; i < m; ++i) {
      if (op == ddp::reduce_op::avg) {
        ref[i] = ddp::is_floating(t) ? ref[i] / size : std::trunc(ref[i] / size);
        magnitude[i] /= size;
      }
      const double tol = ddp::is_floating(t) ? 3 * u * std::abs(ref[i]) + (size + 1) * acc_u * magnitude[i] +
                                                   (t == ddp::dtype::f16 ? 0x1p-24 : 0.0)
                                             : 0.0;
      SUITE_EXPECT(std::abs(got[i] - ref[i]) <= tol, where << " i=" << start + i << ": got " << got[i] << ", want "
                                                           << ref[i] << " (tolerance " << tol << ")");
    }
  }
  suite::expect_same_bits_everywhere(comm, b, where);
}

/// Every dtype and operator at every size class.
inline void every_dtype_op_and_size(ddp::communicator_ref comm, std::size_t chunk_bytes, const std::string& label,
                                    int levels = 1) {
  for (ddp::dtype t : suite::all_dtypes()) {
    for (ddp::reduce_op op : suite::all_ops()) {
      for (std::size_t n : size_classes(comm.size(), chunk_bytes / ddp::size_of(t))) {
        check_allreduce(comm, t, op, n, label, levels);
      }
    }
  }
}

/// Mixed dtypes and many tensors in one call, spanning chunk boundaries.
inline void coalesced_across_chunks(ddp::communicator_ref comm, std::size_t chunk_bytes) {
  std::vector<suite::buffer> bufs;
  const std::vector<ddp::dtype> types{ddp::dtype::f32, ddp::dtype::bf16, ddp::dtype::f32, ddp::dtype::i64,
                                      ddp::dtype::f32, ddp::dtype::f16,  ddp::dtype::f32};
  for (std::size_t k = 0; k < types.size(); ++k) {
    const std::size_t n = (k % 2 ? 3 : chunk_bytes / 4 + 1) + k * 17;
    bufs.emplace_back(types[k], n);
    for (std::size_t i = 0; i < n; ++i) bufs.back().set(i, suite::value(comm.rank(), i + k));
  }
  std::vector<ddp::tensor_view> views;
  for (auto& b : bufs) views.push_back(b.view());
  comm.allreduce(views, ddp::reduce_op::avg).wait();
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    for (std::size_t i = 0; i < bufs[k].count(); ++i) {
      double want = 0;
      for (int r = 0; r < comm.size(); ++r) want += suite::value(r, i + k);
      want = ddp::is_floating(bufs[k].type) ? want / comm.size() : std::trunc(want / comm.size());
      suite::expect_close(bufs[k].get(i), want, bufs[k].type,
                          [&] { return std::string("coalesced across chunks, tensor " + std::to_string(k)); });
    }
    suite::expect_same_bits_everywhere(comm, bufs[k], "coalesced across chunks, tensor " + std::to_string(k));
  }
}

/// The pre-multiplied sum gives the bits of "scale in place, then sum" (the averaging rule's
/// arithmetic), for every floating dtype at every size class, and in one coalesced call with an
/// integer tensor (summed as it is) and several tensors per dtype group.
inline void premul_sum_matches_scale_then_sum(ddp::communicator_ref comm, std::size_t chunk_bytes,
                                              const std::string& label) {
  SUITE_EXPECT(comm.has_premul_sum(), label << ": the shared-memory communicator has a pre-multiplied sum");
  const double factor = 1.0 / comm.size();
  const std::vector<ddp::dtype> floats{ddp::dtype::f64, ddp::dtype::f32, ddp::dtype::bf16, ddp::dtype::f16};
  for (ddp::dtype t : floats) {
    for (std::size_t n : size_classes(comm.size(), chunk_bytes / ddp::size_of(t))) {
      // Two tensors of t and an i32 tensor in one call.
      std::vector<suite::buffer> fused, reference;
      for (ddp::dtype u : {t, ddp::dtype::i32, t}) {
        fused.emplace_back(u, n + (u == t ? 0 : 5));
        reference.emplace_back(u, n + (u == t ? 0 : 5));
      }
      for (std::size_t k = 0; k < fused.size(); ++k) {
        for (std::size_t i = 0; i < fused[k].count(); ++i) {
          fused[k].set(i, value(fused[k].type, comm.rank(), i + 3 * k));
          reference[k].set(i, value(fused[k].type, comm.rank(), i + 3 * k));
        }
        const auto r = reference[k].view();
        ddp::detail::scale_in_place(r.type, r.data, r.count, factor);
      }
      std::vector<ddp::tensor_view> fv, rv;
      for (auto& b : fused) fv.push_back(b.view());
      for (auto& b : reference) rv.push_back(b.view());
      comm.allreduce_premul_sum(fv, factor).wait();
      comm.allreduce(rv, ddp::reduce_op::sum).wait();
      const std::string where = label + " premul sum " + std::string(ddp::name_of(t)) + " n=" + std::to_string(n) +
                                " x 1/" + std::to_string(comm.size());
      for (std::size_t k = 0; k < fused.size(); ++k) {
        SUITE_EXPECT(fv[k].bytes() == 0 || std::memcmp(fv[k].data, rv[k].data, fv[k].bytes()) == 0,
                     where << ", tensor " << k << " (" << ddp::name_of(fv[k].type)
                           << "): not the bits of scaling in place, then summing");
        suite::expect_same_bits_everywhere(comm, fused[k], where);
      }
      // And it is the average (floating tensors), the sum (the integer one).
      for (std::size_t i = 0; i < n && i < 64; ++i) {
        double want = 0;
        for (int q = 0; q < comm.size(); ++q) want += stored(t, value(t, q, i));
        suite::expect_close(fused[0].get(i), want / comm.size(), t,
                            [&] { return std::string(where + " is the average"); });
      }
    }
  }
}

/// Everything of this file plus the generic suite.
inline void run_all(ddp::communicator_ref comm, std::size_t chunk_bytes, const std::string& label, int levels = 1) {
  suite::run_all(comm);
  every_dtype_op_and_size(comm, chunk_bytes, label, levels);
  coalesced_across_chunks(comm, chunk_bytes);
  suite::allreduce_coalesced_groups(comm, chunk_bytes + 99);
  premul_sum_matches_scale_then_sum(comm, chunk_bytes, label);
}

}  // namespace shm_cases
