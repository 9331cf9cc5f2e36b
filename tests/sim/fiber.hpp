#pragma once
// The simulation's processes are fibers (docs/testing.md, "Deterministic simulation"): each runs
// the production Manager on a stack of its own, but every one of them, and the scheduler, runs
// on one thread, and control passes between them by a user-space context switch. Only one ever
// ran at a time anyway; as threads, each hand-off took two kernel context switches (about 10 us
// each here), and those were nearly all of the simulation's cost.
//
// What a switch carries besides the registers and the stack: the C++ runtime's per-thread
// exception state (the stack of exceptions being handled, the count of uncaught ones). A process
// may reach a scheduling point inside a catch block (the Manager writes to the store while it
// handles a collective's error); without its own copy of that state, another process catching an
// exception meanwhile would corrupt it. Each context saves and restores it, as threads did.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include <cxxabi.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

// The sanitizers are told about every switch (their fiber interfaces), or they would take one
// stack's frames for another's.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DDP_SIM_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define DDP_SIM_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(DDP_SIM_ASAN)
#define DDP_SIM_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__) && !defined(DDP_SIM_TSAN)
#define DDP_SIM_TSAN 1
#endif
#ifdef DDP_SIM_ASAN
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef DDP_SIM_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace sim::detail {

/// The runtime's per-thread exception state (`__cxa_eh_globals` in libstdc++ and libc++abi: the
/// exceptions being handled, the number of uncaught ones), copied out and back as a whole.
struct eh_state {
  static constexpr std::size_t size = sizeof(void*) + sizeof(unsigned int);
  alignas(void*) unsigned char bytes[size] = {};

  void save() noexcept { std::memcpy(bytes, static_cast<void*>(abi::__cxa_get_globals()), size); }
  void restore() const noexcept { std::memcpy(static_cast<void*>(abi::__cxa_get_globals()), bytes, size); }
};

/// A fiber's stack: mapped once with a guard page below it (an overflow faults instead of
/// overwriting another stack), and kept for the next fiber of this thread when released.
class stack {
 public:
  static constexpr std::size_t bytes = std::size_t(1) << 20;  // touched lazily: 1 MiB costs what is used

  stack() = default;
  stack(const stack&) = delete;
  stack& operator=(const stack&) = delete;
  stack(stack&& o) noexcept : base_(std::exchange(o.base_, nullptr)) {}
  stack& operator=(stack&& o) noexcept {
    std::swap(base_, o.base_);
    return *this;
  }
  ~stack() { release(); }

  /// A stack from this thread's pool, or a new one.
  static stack take() {
    auto& free = pool();
    stack s;
    if (!free.empty()) {
      s.base_ = free.back();
      free.pop_back();
      return s;
    }
    void* m = ::mmap(nullptr, bytes + guard(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("sim::fiber: cannot map a stack");
    if (::mprotect(m, guard(), PROT_NONE) != 0) {
      ::munmap(m, bytes + guard());
      throw std::runtime_error("sim::fiber: cannot protect a stack's guard page");
    }
    s.base_ = m;
    return s;
  }
  /// Back to the pool.
  void release() noexcept {
    if (!base_) return;
    try {
      pool().push_back(base_);
    } catch (...) {
      ::munmap(base_, bytes + guard());
    }
    base_ = nullptr;
  }

  [[nodiscard]] void* low() const noexcept { return static_cast<char*>(base_) + guard(); }

 private:
  static std::size_t guard() noexcept { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }
  struct free_list : std::vector<void*> {
    ~free_list() {
      for (void* m : *this) ::munmap(m, bytes + guard());
    }
  };
  static free_list& pool() {
    thread_local free_list p;
    return p;
  }

  void* base_ = nullptr;
};

#if defined(__x86_64__) && defined(__ELF__) && !defined(DDP_SIM_UCONTEXT)
#define DDP_SIM_FIBER_ASM 1
// The switch itself, for x86-64 (System V): pushes the registers a callee must preserve (and the
// SSE and x87 control words) on the running stack, stores the stack pointer, loads the other
// context's, and pops its registers. No system call (swapcontext's signal mask costs one each
// time, a third of the simulation's time). Elsewhere, or with DDP_SIM_UCONTEXT, swapcontext.
extern "C" void ddp_sim_switch(void** save_sp, void* load_sp);
extern "C" void ddp_sim_fiber_start();
asm(R"(
  .pushsection .text.ddp_sim_switch,"axG",@progbits,ddp_sim_switch,comdat
  .globl ddp_sim_switch
  .hidden ddp_sim_switch
  .type ddp_sim_switch,@function
ddp_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ddp_sim_switch, .-ddp_sim_switch
  .popsection

  .pushsection .text.ddp_sim_fiber_start,"axG",@progbits,ddp_sim_fiber_start,comdat
  .globl ddp_sim_fiber_start
  .hidden ddp_sim_fiber_start
  .type ddp_sim_fiber_start,@function
ddp_sim_fiber_start:
  .cfi_startproc
  .cfi_undefined rip
  movq %r12, %rdi
  callq *%r13
  ud2
  .cfi_endproc
  .size ddp_sim_fiber_start, .-ddp_sim_fiber_start
  .popsection
)");
#endif

/// One execution context: the scheduler's (the thread it runs on) or a fiber's. Control passes
/// only between the scheduler and a fiber, never from one fiber to another.
class context {
 public:
  context() = default;
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  ~context() {
#ifdef DDP_SIM_TSAN
    if (tsan_ && owns_tsan_) __tsan_destroy_fiber(tsan_);
#endif
  }

  /// Makes this a fiber that calls `entry(arg)` on `s` when first switched to. `entry` must not
  /// return, nor let an exception out: it ends with `leave`.
  void make(stack& s, void (*entry)(void*), void* arg) {
    entry_ = entry;
    arg_ = arg;
    low_ = s.low();
    size_ = stack::bytes;
#ifdef DDP_SIM_TSAN
    tsan_ = __tsan_create_fiber(0);
    owns_tsan_ = true;
#endif
#ifdef DDP_SIM_FIBER_ASM
    // The frame ddp_sim_switch pops: the control words, r15, r14, r13 (the function), r12 (its
    // argument), rbx, rbp, then the return address, ddp_sim_fiber_start, which calls first(this)
    // with the stack pointer 16-byte aligned (the top of the stack).
    auto top = reinterpret_cast<std::uintptr_t>(s.low()) + stack::bytes;
    top &= ~std::uintptr_t(15);
    auto* frame = reinterpret_cast<std::uint64_t*>(top - 64);
    const std::uint32_t mxcsr = 0x1f80;  // the defaults: every exception masked, round to nearest
    const std::uint16_t fpucw = 0x037f;
    std::memset(frame, 0, 64);
    std::memcpy(frame, &mxcsr, sizeof mxcsr);
    std::memcpy(reinterpret_cast<char*>(frame) + 4, &fpucw, sizeof fpucw);
    void (*first_fn)(void*) = &first;
    frame[3] = reinterpret_cast<std::uintptr_t>(first_fn);
    frame[4] = reinterpret_cast<std::uintptr_t>(this);
    frame[7] = reinterpret_cast<std::uintptr_t>(&ddp_sim_fiber_start);
    sp_ = frame;
#else
    if (::getcontext(&uc_) != 0) throw std::runtime_error("sim::fiber: getcontext failed");
    uc_.uc_stack.ss_sp = s.low();
    uc_.uc_stack.ss_size = stack::bytes;
    uc_.uc_link = nullptr;
    // makecontext passes ints: the context's address, in two halves.
    const auto self = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(this));
    ::makecontext(&uc_, reinterpret_cast<void (*)()>(&trampoline), 2, static_cast<unsigned>(self >> 32),
                  static_cast<unsigned>(self & 0xffffffffu));
#endif
  }

  /// Suspends `from` (the context running now) and resumes `to`, each with its own exception
  /// state. Returns when `to` switches back to `from`.
  static void jump(context& from, context& to) { pass(from, to, false); }

  /// The last switch of a fiber that has ended: `from` is never resumed.
  static void leave(context& from, context& to) { pass(from, to, true); }

 private:
  static void pass(context& from, context& to, [[maybe_unused]] bool final) {
    from.eh_.save();
    to.eh_.restore();
    to.resumer_ = &from;
#ifdef DDP_SIM_TSAN
    if (!from.tsan_) from.tsan_ = __tsan_get_current_fiber();  // the scheduler's thread
    __tsan_switch_to_fiber(to.tsan_, 0);
#endif
#ifdef DDP_SIM_ASAN
    __sanitizer_start_switch_fiber(final ? nullptr : &from.fake_stack_, to.low_, to.size_);
#endif
#ifdef DDP_SIM_FIBER_ASM
    ddp_sim_switch(&from.sp_, to.sp_);
#else
    ::swapcontext(&from.uc_, &to.uc_);
#endif
    // Back in `from`, resumed by `to` (control passes only between the scheduler and a fiber).
#ifdef DDP_SIM_ASAN
    __sanitizer_finish_switch_fiber(from.fake_stack_, &to.low_, &to.size_);
#endif
  }

  // A fiber's first frame.
  static void first(void* arg) {
    auto* self = static_cast<context*>(arg);
#ifdef DDP_SIM_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &self->resumer_->low_, &self->resumer_->size_);
#endif
    self->entry_(self->arg_);
  }

#ifdef DDP_SIM_FIBER_ASM
  void* sp_ = nullptr;
#else
  static void trampoline(unsigned hi, unsigned lo) {
    first(reinterpret_cast<context*>(static_cast<std::uintptr_t>((static_cast<std::uint64_t>(hi) << 32) | lo)));
  }

  ucontext_t uc_{};
#endif
  void (*entry_)(void*) = nullptr;
  void* arg_ = nullptr;
  context* resumer_ = nullptr;  // who switched to this context last
  const void* low_ = nullptr;   // its stack (the scheduler's: learnt at the first switch back)
  std::size_t size_ = 0;
  [[maybe_unused]] void* fake_stack_ = nullptr;  // AddressSanitizer's, while suspended
  [[maybe_unused]] void* tsan_ = nullptr;        // ThreadSanitizer's fiber
  [[maybe_unused]] bool owns_tsan_ = false;
  eh_state eh_;
};

}  // namespace sim::detail
