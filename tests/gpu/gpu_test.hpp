#pragma once
// A tiny test harness for the GPU tests: no Catch2, no MPI, so that scripts/gpu-check.sh builds
// and runs them on a GPU machine that has neither. Cases register themselves with GPU_CASE; the
// main (device_paths_main.cpp) runs them one by one and prints one line per case:
//   RESULT <case> PASS
//   RESULT <case> FAIL: <first failed check or exception>
// GPU_CHECK records a failure and goes on; GPU_REQUIRE stops the case. A case may print
// `BANDWIDTH ...` lines of its own (collected by scripts/gpu-check.sh).

#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace gpu_test {

/// A registered case.
struct test_case {
  std::string name;
  std::function<void()> body;
};

/// Every registered case, in registration order.
inline std::vector<test_case>& registry() {
  static std::vector<test_case> cases;
  return cases;
}

/// Registers a case at static-initialisation time.
struct registrar {
  registrar(const char* name, std::function<void()> body) { registry().push_back({name, std::move(body)}); }
};

/// Failures of the running case.
inline std::vector<std::string>& failures() {
  static std::vector<std::string> f;
  return f;
}

/// Thrown by GPU_REQUIRE to end the case.
struct abort_case {};

/// Records a failure of the running case; thread-safe (ranks run on threads).
inline void record_failure(const std::string& what, const char* file, int line) {
  static std::mutex mutex;
  std::ostringstream os;
  os << file << ":" << line << ": " << what;
  std::lock_guard lk(mutex);
  failures().push_back(os.str());
  std::printf("  check failed: %s\n", os.str().c_str());
}

/// "a == b" with both values, for the failure message.
template <class A, class B>
std::string describe_eq(const char* a_text, const char* b_text, const A& a, const B& b) {
  std::ostringstream os;
  os << a_text << " == " << b_text << " (" << a << " vs " << b << ")";
  return os.str();
}

}  // namespace gpu_test

#define GPU_CASE_CONCAT2(a, b) a##b
#define GPU_CASE_CONCAT(a, b) GPU_CASE_CONCAT2(a, b)
/// Defines and registers a case: `GPU_CASE("name") { ...checks... }`.
#define GPU_CASE(name)                                                                                                 \
  static void GPU_CASE_CONCAT(gpu_case_, __LINE__)();                                                                  \
  static const ::gpu_test::registrar GPU_CASE_CONCAT(gpu_registrar_, __LINE__)(name,                                   \
                                                                               &GPU_CASE_CONCAT(gpu_case_, __LINE__)); \
  static void GPU_CASE_CONCAT(gpu_case_, __LINE__)()

/// Records a failure if `cond` is false; the case goes on.
#define GPU_CHECK(cond)                                                              \
  do {                                                                               \
    if (!(cond)) ::gpu_test::record_failure("CHECK(" #cond ")", __FILE__, __LINE__); \
  } while (false)

/// Records a failure (with both values) unless `a == b`; the case goes on.
#define GPU_CHECK_EQ(a, b)                                                                             \
  do {                                                                                                 \
    const auto& gpu_a_ = (a);                                                                          \
    const auto& gpu_b_ = (b);                                                                          \
    if (!(gpu_a_ == gpu_b_))                                                                           \
      ::gpu_test::record_failure(::gpu_test::describe_eq(#a, #b, gpu_a_, gpu_b_), __FILE__, __LINE__); \
  } while (false)

/// Records a failure and ends the case if `cond` is false.
#define GPU_REQUIRE(cond)                                                   \
  do {                                                                      \
    if (!(cond)) {                                                          \
      ::gpu_test::record_failure("REQUIRE(" #cond ")", __FILE__, __LINE__); \
      throw ::gpu_test::abort_case{};                                       \
    }                                                                       \
  } while (false)

/// Records a failure unless `expr` throws an exception of type `E`.
#define GPU_CHECK_THROWS_AS(expr, E)                                                                       \
  do {                                                                                                     \
    bool gpu_threw_ = false;                                                                               \
    try {                                                                                                  \
      (void)(expr);                                                                                        \
    } catch (const E&) {                                                                                   \
      gpu_threw_ = true;                                                                                   \
    } catch (...) {                                                                                        \
    }                                                                                                      \
    if (!gpu_threw_) ::gpu_test::record_failure("CHECK_THROWS_AS(" #expr ", " #E ")", __FILE__, __LINE__); \
  } while (false)
