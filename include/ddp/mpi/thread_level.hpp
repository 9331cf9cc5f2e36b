#pragma once
/// @file mpi/thread_level.hpp
/// @brief MPI thread support levels as a C++ enum, ordered like MPI's constants.

#include <mpi.h>

#include <ostream>
#include <string_view>

namespace ddp::mpi {

/// The thread support MPI provides. Ordered: `single < funneled < serialized < multiple`.
enum class thread_level : int {
  single = MPI_THREAD_SINGLE,          ///< one thread in the process
  funneled = MPI_THREAD_FUNNELED,      ///< only the thread that initialised MPI calls it
  serialized = MPI_THREAD_SERIALIZED,  ///< any thread, one at a time
  multiple = MPI_THREAD_MULTIPLE,      ///< any thread, concurrently
};

/// MPI's name of the level, e.g. "MPI_THREAD_MULTIPLE".
[[nodiscard]] constexpr std::string_view name_of(thread_level l) noexcept {
  switch (l) {
    case thread_level::single: return "MPI_THREAD_SINGLE";
    case thread_level::funneled: return "MPI_THREAD_FUNNELED";
    case thread_level::serialized: return "MPI_THREAD_SERIALIZED";
    case thread_level::multiple: return "MPI_THREAD_MULTIPLE";
  }
  return "MPI_THREAD_?";
}

/// Prints `name_of(l)`.
inline std::ostream& operator<<(std::ostream& os, thread_level l) { return os << name_of(l); }

}  // namespace ddp::mpi
