#pragma once
/// @file device/emulated.hpp
/// @brief The host emulation of the device runtime (`ddp::emulated_device::runtime`) and a
/// device communicator over any host communicator (`ddp::emulated_device::communicator`).
///
/// Why: the components' device code paths (buckets per device, copies ordered on streams,
/// events between streams, the no-host-sync contract, their error paths) run and are tested in
/// CI without a GPU, and a user can run the logic of a CUDA trainer on a CPU.
///
/// The model:
/// - **Device memory is host memory** (256-byte aligned) that the runtime allocates and tracks;
///   whoever views it tags it `device::cuda(k)`. Tests may read it directly once the work that
///   writes it completed (after `synchronize`, or a completed `query`). Fresh allocations are
///   filled with 0xA5 bytes, never zero, like uninitialised device memory: a missing zero fill
///   shows.
/// - **A stream is a FIFO queue of steps.** A step is a function that returns true when it is
///   done: a copy, a zero fill, a free, an event's record marker finish in one call; a collective
///   of the emulated communicator returns false until its host collective completed, so nothing
///   ever blocks inside a step. Waiting for an event is a step that is done once that record of
///   the event completed.
/// - **Execution is lazy and deterministic**: enqueuing runs nothing. `query`, `synchronize` and
///   `run_ready` pump: they run the head step of every stream that is not held, in stream
///   creation order, popping the finished ones, until a full pass makes no progress. Steps run in
///   the pumping thread, one thread at a time, never under the lock that guards the queues.
/// - **Events as in CUDA**: an event is complete once the marker of its last record ran; a never
///   recorded event is complete; recording again makes it incomplete until the new marker runs; a
///   wait captures the record current at the time of the call.
/// - **Errors are sticky per stream**: a step that throws fails its stream; the stream's later
///   steps are not run (frees still are), events recorded behind it fail with the error, and so
///   do streams that wait for them; `query` and `synchronize` of a failed event rethrow it.
/// - **A host synchronisation is a call of `synchronize`**, counted by `host_syncs()`: the
///   components' promise that the hot path does not block the host is checked with it. A
///   collective over host tensors through the emulated communicator is one (it is staged through
///   device memory and completes before it returns).
/// - Test hooks (not in the interface): `launch` (a kernel), `hold`/`release` (a held stream runs
///   nothing, so a test can see what has not happened yet), and counters. A `synchronize` that
///   could only complete after a held stream is released throws `usage_error` instead of hanging.
///
/// Not emulated: the legacy default stream's implicit synchronisation (the null stream is an
/// ordinary stream here: stricter, so code correct here is ordered on CUDA too), timing, and
/// concurrency between device work and the host (device work runs only when the host pumps).

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/detail/host_staging.hpp>
#include <ddp/device.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::emulated_device {

/// The device runtime emulated on the host (see the file comment). Thread-safe: any thread may
/// enqueue; one thread at a time pumps.
class runtime final : public device_runtime {
 public:
  /// Alignment of every allocation.
  static constexpr std::size_t alignment = 256;
  /// Default deadline of `synchronize`.
  static constexpr std::chrono::milliseconds default_sync_timeout{std::chrono::seconds(60)};

  /// A runtime for rank `rank` (named in its errors); `synchronize` gives up after `sync_timeout`.
  explicit runtime(int rank, std::chrono::milliseconds sync_timeout = default_sync_timeout)
      : rank_(rank), sync_timeout_ms_(sync_timeout.count()) {
    streams_.push_back(std::make_unique<stream_state>(0, device::cuda(0)));  // the null stream
  }

  /// Runs nothing more; frees every allocation, stream and event.
  ~runtime() override {
    std::vector<step> dropped;
    {
      std::lock_guard lk(m_);
      for (auto& s : streams_) {
        for (auto& st : s->steps) dropped.push_back(std::move(st));
        s->steps.clear();
      }
    }
    dropped.clear();  // a step's state (a pending host collective) goes before the memory
    for (auto& [p, a] : allocs_) ::operator delete (p, std::align_val_t{alignment});
  }

  [[nodiscard]] std::string_view name() const noexcept override { return "emulated"; }

  // ---- device_runtime -------------------------------------------------------------------------

  /// Host memory tracked as memory of `where` (which must be a CUDA device), usable at once.
  [[nodiscard]] void* allocate(device where, std::size_t bytes, device_stream stream) override {
    if (!where.is_cuda()) {
      throw usage_error(rank_, "emulated_device::allocate", "device memory on " + where.str() + ": not a device");
    }
    std::lock_guard lk(m_);
    (void)find_stream(stream, "emulated_device::allocate");
    if (bytes == 0) return nullptr;
    auto* p = static_cast<std::byte*>(::operator new (bytes, std::align_val_t{alignment}));
    std::memset(p, 0xA5, bytes);
    allocs_.emplace(p, allocation{bytes, where, false});
    return p;
  }

  /// Frees `memory` once the work enqueued on `stream` so far ran. An unknown pointer, or one
  /// already being freed, is counted by `bad_frees()` and left alone.
  void deallocate(void* memory, device_stream stream) noexcept override {
    if (memory == nullptr) return;
    std::lock_guard lk(m_);
    auto it = allocs_.find(static_cast<std::byte*>(memory));
    stream_state* s = lookup_stream(stream);
    if (it == allocs_.end() || it->second.freeing || s == nullptr || s->destroyed) {
      bad_frees_.fetch_add(1);
      return;
    }
    it->second.freeing = true;
    try {
      s->steps.push_back(step::free_step(memory));
    } catch (...) {  // out of memory for the step: free at destruction
      bad_frees_.fetch_add(1);
    }
  }

  /// One step doing the copies in order.
  void copy(std::span<const copy_region> regions, device_stream stream) override {
    std::vector<copy_region> rs(regions.begin(), regions.end());
    enqueue_step(stream, "emulated_device::copy", step::run_step([this, rs = std::move(rs)] {
                   for (const copy_region& r : rs) {
                     if (r.bytes == 0) continue;
                     std::memcpy(r.dst, r.src, r.bytes);
                     copies_.fetch_add(1);
                     copied_bytes_.fetch_add(r.bytes);
                   }
                   return true;
                 }));
  }

  /// One step writing `bytes` zero bytes.
  void zero(void* memory, std::size_t bytes, device_stream stream) override {
    enqueue_step(stream, "emulated_device::zero", step::run_step([memory, bytes] {
                   if (bytes > 0) std::memset(memory, 0, bytes);
                   return true;
                 }));
  }

  [[nodiscard]] device_stream create_stream(device where) override {
    std::lock_guard lk(m_);
    streams_.push_back(std::make_unique<stream_state>(next_stream_id_++, where));
    return {streams_.back().get()};
  }

  /// The stream goes once its queue is empty (the null stream stays).
  void destroy_stream(device_stream stream) noexcept override {
    if (stream.native == nullptr) return;
    std::lock_guard lk(m_);
    if (stream_state* s = lookup_stream(stream)) s->destroyed = true;
  }

  [[nodiscard]] device_event create_event(device where) override {
    std::lock_guard lk(m_);
    auto ev = std::make_shared<event_state>();
    ev->where = where;
    void* key = ev.get();
    events_.emplace(key, std::move(ev));
    return {key};
  }

  /// The event goes now; markers and waits still pending keep its state alive.
  void destroy_event(device_event event) noexcept override {
    std::lock_guard lk(m_);
    events_.erase(event.native);
  }

  void record(device_event event, device_stream stream) override {
    std::lock_guard lk(m_);
    stream_state* s = find_stream(stream, "emulated_device::record");
    std::shared_ptr<event_state> ev = find_event(event, "emulated_device::record");
    const std::uint64_t gen = ++ev->recorded;
    ev->pending.emplace(gen, s);
    s->steps.push_back(step::marker_step(std::move(ev), gen));
  }

  void wait(device_stream stream, device_event event) override {
    std::lock_guard lk(m_);
    stream_state* s = find_stream(stream, "emulated_device::wait");
    std::shared_ptr<event_state> ev = find_event(event, "emulated_device::wait");
    const std::uint64_t gen = ev->recorded;
    if (gen == 0 || (!ev->pending.contains(gen) && !ev->failed.contains(gen))) return;  // nothing to wait for
    s->steps.push_back(step::wait_step(std::move(ev), gen));
  }

  /// Pumps (unless another thread is pumping, or this is a step), then answers.
  /// @throws the error of the stream the event's last record failed on
  [[nodiscard]] bool query(device_event event) override {
    run_ready();
    std::lock_guard lk(m_);
    return complete(*find_event(event, "emulated_device::query"));
  }

  /// Pumps until the event completed: a host synchronisation (counted by `host_syncs()`).
  /// @throws usage_error if it could complete only after a held stream is released; timeout_error
  ///   after the runtime's sync timeout; the error of the stream the event failed on
  void synchronize(device_event event) override {
    host_syncs_.fetch_add(1);
    const auto since = clock::now();
    const auto deadline = since + sync_timeout();
    if (pumper_.load() == std::this_thread::get_id()) {
      throw usage_error(rank_, "emulated_device::synchronize", "called from a step running on a stream");
    }
    // The pump is polled for (std::timed_mutex::try_lock_until is opaque to ThreadSanitizer), and
    // given back while sleeping: another thread may need it to abort a communicator whose
    // collective this event waits for.
    std::unique_lock pump(pump_m_, std::defer_lock);
    for (unsigned idle = 0;; ++idle) {
      if (pump.owns_lock() || pump.try_lock()) {
        const pass_result r = pump_until_stalled();
        std::lock_guard lk(m_);
        std::shared_ptr<event_state> ev = find_event(event, "emulated_device::synchronize");
        if (complete(*ev)) return;
        if (std::string held = held_blocker(*ev); !held.empty()) {
          throw usage_error(rank_, "emulated_device::synchronize",
                            "the event would wait forever: " + held + " (release() it first)");
        }
        if (!r.in_progress) {
          throw usage_error(rank_, "emulated_device::synchronize",
                            "the event would wait forever: no stream can make progress");
        }
      }
      if (clock::now() >= deadline) throw sync_timeout_error(since);
      if (idle < 16) continue;
      if (idle < 1024) {
        std::this_thread::yield();
      } else {
        if (pump.owns_lock()) pump.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  // ---- emulation (not in the interface) -------------------------------------------------------

  /// Enqueues a step: `fn` is called on later pumps until it returns true; it must not block
  /// (a collective issues its host work the first time, then tests it). An exception from it
  /// fails the stream.
  void enqueue(device_stream stream, std::function<bool()> fn) {
    enqueue_step(stream, "emulated_device::enqueue", step::run_step(std::move(fn)));
  }

  /// Emulates a kernel: a step that runs `kernel` once.
  void launch(device_stream stream, std::function<void()> kernel) {
    enqueue_step(stream, "emulated_device::launch", step::run_step([k = std::move(kernel)] {
                   k();
                   return true;
                 }));
  }

  /// Pumps until no stream can make progress (nothing if another thread is pumping: it will;
  /// nothing if called from a step).
  void run_ready() {
    if (pumper_.load() == std::this_thread::get_id()) return;  // called from a step
    std::unique_lock pump(pump_m_, std::try_to_lock);
    if (pump.owns_lock()) pump_until_stalled();
  }

  /// A held stream runs nothing (not even its head step in progress) until `release`.
  void hold(device_stream stream) { set_held(stream, true, "emulated_device::hold"); }
  /// Lets a held stream run again (at the next pump).
  void release(device_stream stream) { set_held(stream, false, "emulated_device::release"); }

  /// Fails `stream` with `e` now (waiting for a running pump): its pending steps are dropped
  /// (their state destroyed: a pending host collective is abandoned), frees still run, events
  /// recorded on it fail. Later steps on it are dropped too. The emulated communicator does this
  /// when destroyed with collectives pending.
  void fail_stream(device_stream stream, std::exception_ptr e) {
    exclusive([&] {
      std::vector<step> dropped;
      {
        std::lock_guard lk(m_);
        stream_state* s = find_stream(stream, "emulated_device::fail_stream");
        if (!s->error) s->error = std::move(e);
        drain_failed(*s, dropped);
      }
    });
  }

  /// Runs `fn` while no step runs (in this thread; directly if it is the pumping one). The
  /// emulated communicator aborts its host communicator this way, so that an abort never races
  /// with a step that is issuing or testing a collective.
  void exclusive(const std::function<void()>& fn) {
    if (pumper_.load() == std::this_thread::get_id()) {
      fn();
      return;
    }
    std::lock_guard pump(pump_m_);
    fn();
  }

  /// Deadline of `synchronize`.
  [[nodiscard]] std::chrono::milliseconds sync_timeout() const noexcept {
    return std::chrono::milliseconds(sync_timeout_ms_.load());
  }
  /// Sets the deadline of `synchronize`.
  void set_sync_timeout(std::chrono::milliseconds t) noexcept { sync_timeout_ms_.store(t.count()); }

  /// Number of `synchronize` calls so far (the host synchronisations).
  [[nodiscard]] std::size_t host_syncs() const noexcept { return host_syncs_.load(); }
  /// Number of copy regions (of at least one byte) that ran so far.
  [[nodiscard]] std::size_t copies() const noexcept { return copies_.load(); }
  /// Bytes those copies moved.
  [[nodiscard]] std::size_t copied_bytes() const noexcept { return copied_bytes_.load(); }
  /// Allocations not freed yet (a free still pending on a stream counts).
  [[nodiscard]] std::size_t live_allocations() const {
    std::lock_guard lk(m_);
    return allocs_.size();
  }
  /// Events created and not destroyed.
  [[nodiscard]] std::size_t live_events() const {
    std::lock_guard lk(m_);
    return events_.size();
  }
  /// Steps enqueued on every stream and not finished.
  [[nodiscard]] std::size_t pending_steps() const {
    std::lock_guard lk(m_);
    std::size_t n = 0;
    for (const auto& s : streams_) n += s->steps.size();
    return n;
  }
  /// True if [p, p + bytes) lies inside one live allocation.
  [[nodiscard]] bool is_device_memory(const void* p, std::size_t bytes) const {
    std::lock_guard lk(m_);
    const auto* b = static_cast<const std::byte*>(p);
    auto it = allocs_.upper_bound(const_cast<std::byte*>(b));
    if (it == allocs_.begin()) return false;
    --it;
    return b >= it->first && b + bytes <= it->first + it->second.bytes;
  }
  /// Frees of a pointer that was not a live allocation (or on an unknown stream).
  [[nodiscard]] std::size_t bad_frees() const noexcept { return bad_frees_.load(); }
  /// The rank named in errors.
  [[nodiscard]] int rank() const noexcept { return rank_; }

 private:
  struct stream_state;

  struct event_state {
    device where;
    std::uint64_t recorded = 0;                          ///< generation of the last record
    std::map<std::uint64_t, stream_state*> pending;      ///< records whose marker did not run
    std::map<std::uint64_t, std::exception_ptr> failed;  ///< records whose stream failed
  };

  struct step {
    enum class kind : unsigned char { run, marker, wait, free };
    kind what = kind::run;
    std::function<bool()> fn;         // run
    std::shared_ptr<event_state> ev;  // marker, wait
    std::uint64_t gen = 0;            // marker, wait
    void* memory = nullptr;           // free

    static step run_step(std::function<bool()> f) {
      step s;
      s.fn = std::move(f);
      return s;
    }
    static step marker_step(std::shared_ptr<event_state> e, std::uint64_t g) {
      step s;
      s.what = kind::marker;
      s.ev = std::move(e);
      s.gen = g;
      return s;
    }
    static step wait_step(std::shared_ptr<event_state> e, std::uint64_t g) {
      step s = marker_step(std::move(e), g);
      s.what = kind::wait;
      return s;
    }
    static step free_step(void* p) {
      step s;
      s.what = kind::free;
      s.memory = p;
      return s;
    }
  };

  struct stream_state {
    stream_state(int i, device w) : id(i), where(w) {}
    int id;
    device where;
    std::deque<step> steps;
    bool held = false;
    bool destroyed = false;
    std::exception_ptr error;  // non-null: failed

    [[nodiscard]] std::string str() const { return "stream #" + std::to_string(id) + " (" + where.str() + ")"; }
  };

  struct allocation {
    std::size_t bytes = 0;
    device where;
    bool freeing = false;
  };

  struct pass_result {
    bool in_progress = false;  // a step of a stream that is not held is under way
  };

  // Caller holds m_.
  stream_state* lookup_stream(device_stream stream) const noexcept {
    if (stream.native == nullptr) return streams_.front().get();
    for (const auto& s : streams_) {
      if (s.get() == stream.native) return s.get();
    }
    return nullptr;
  }
  stream_state* find_stream(device_stream stream, const char* op) const {
    stream_state* s = lookup_stream(stream);
    if (s == nullptr || s->destroyed) throw usage_error(rank_, op, "not a live stream of this runtime");
    return s;
  }
  std::shared_ptr<event_state> find_event(device_event event, const char* op) const {
    auto it = events_.find(event.native);
    if (it == events_.end()) throw usage_error(rank_, op, "not a live event of this runtime");
    return it->second;
  }
  // True once the last record ran; throws the error it failed with.
  static bool complete(const event_state& ev) {
    if (auto it = ev.failed.find(ev.recorded); it != ev.failed.end()) std::rethrow_exception(it->second);
    return !ev.pending.contains(ev.recorded);
  }

  void enqueue_step(device_stream stream, const char* op, step st) {
    std::lock_guard lk(m_);
    find_stream(stream, op)->steps.push_back(std::move(st));
  }

  void set_held(device_stream stream, bool held, const char* op) {
    std::lock_guard lk(m_);
    find_stream(stream, op)->held = held;
  }

  // "its last record is on stream #1 (cuda:0), behind held stream #2 (cuda:0)", or "" if the
  // event's last record does not depend on a held stream (caller holds m_).
  std::string held_blocker(const event_state& ev) const {
    auto it = ev.pending.find(ev.recorded);
    if (it == ev.pending.end()) return {};
    const stream_state* first = it->second;
    const stream_state* s = first;
    for (int hops = 0; hops < 1024 && s != nullptr; ++hops) {
      if (s->held) {
        return s == first ? "its last record is on held " + s->str()
                          : "its last record is on " + first->str() + ", behind held " + s->str();
      }
      if (s->steps.empty() || s->error) return {};
      const step& head = s->steps.front();
      if (head.what != step::kind::wait) return {};
      auto w = head.ev->pending.find(head.gen);
      if (w == head.ev->pending.end()) return {};
      s = w->second;
    }
    return {};
  }

  // Empties a failed stream (caller holds m_): markers fail, frees run, the rest goes to `dropped`
  // (destroyed by the caller without m_: a step's state may call into a host communicator).
  void drain_failed(stream_state& s, std::vector<step>& dropped) {
    while (!s.steps.empty()) {
      step& h = s.steps.front();
      switch (h.what) {
        case step::kind::marker:
          h.ev->pending.erase(h.gen);
          h.ev->failed.emplace(h.gen, s.error);
          break;
        case step::kind::free: free_now(h.memory); break;
        default: dropped.push_back(std::move(h)); break;
      }
      s.steps.pop_front();
    }
  }

  void free_now(void* memory) noexcept {  // caller holds m_
    auto it = allocs_.find(static_cast<std::byte*>(memory));
    if (it == allocs_.end()) return;
    ::operator delete (it->first, std::align_val_t{alignment});
    allocs_.erase(it);
  }

  // Fails stream `s` with `e` (caller holds m_).
  void fail(stream_state& s, std::exception_ptr e, std::vector<step>& dropped) {
    if (!s.error) s.error = std::move(e);
    drain_failed(s, dropped);
  }

  // One pass over every stream; true if a step finished. Caller holds pump_m_.
  bool pump_pass(pass_result& r) {
    bool progress = false;
    std::vector<stream_state*> order;
    {
      std::lock_guard lk(m_);
      std::erase_if(streams_, [](const auto& s) { return s->destroyed && s->steps.empty(); });
      order.reserve(streams_.size());
      for (const auto& s : streams_) order.push_back(s.get());
    }
    std::vector<step> dropped;
    for (stream_state* s : order) {
      std::unique_lock lk(m_);
      if (s->held || s->steps.empty()) continue;
      if (s->error) {
        drain_failed(*s, dropped);
        progress = true;
        continue;
      }
      step& h = s->steps.front();  // stays valid: only the pumping thread pops
      switch (h.what) {
        case step::kind::marker:
          h.ev->pending.erase(h.gen);
          s->steps.pop_front();
          progress = true;
          break;
        case step::kind::wait:
          if (auto f = h.ev->failed.find(h.gen); f != h.ev->failed.end()) {
            fail(*s, f->second, dropped);
            progress = true;
          } else if (!h.ev->pending.contains(h.gen)) {
            s->steps.pop_front();
            progress = true;
          }
          break;
        case step::kind::free:
          free_now(h.memory);
          s->steps.pop_front();
          progress = true;
          break;
        case step::kind::run: {
          lk.unlock();
          bool done = false;
          std::exception_ptr e;
          try {
            done = h.fn();
          } catch (...) {
            e = std::current_exception();
          }
          lk.lock();
          if (e) {
            dropped.push_back(std::move(s->steps.front()));
            s->steps.pop_front();
            fail(*s, e, dropped);
            progress = true;
          } else if (done) {
            dropped.push_back(std::move(s->steps.front()));  // its state goes without m_
            s->steps.pop_front();
            progress = true;
          } else {
            r.in_progress = true;
          }
          break;
        }
      }
      if (!dropped.empty()) {
        lk.unlock();
        dropped.clear();
      }
    }
    return progress;
  }

  // Pumps until a full pass makes no progress. Caller holds pump_m_.
  pass_result pump_until_stalled() {
    pumper_.store(std::this_thread::get_id());
    struct reset {
      std::atomic<std::thread::id>& p;
      ~reset() { p.store(std::thread::id()); }
    } guard{pumper_};
    pass_result r;
    for (;;) {
      r = {};
      if (!pump_pass(r)) return r;
    }
  }

  timeout_error sync_timeout_error(clock::time_point since) const {
    const auto waited = std::chrono::round<std::chrono::milliseconds>(clock::now() - since).count();
    return timeout_error(rank_, "emulated_device::synchronize",
                         "the event did not complete within the " + std::to_string(sync_timeout().count()) +
                             " ms timeout: waited " + std::to_string(waited) + " ms");
  }

  const int rank_;
  std::atomic<std::chrono::milliseconds::rep> sync_timeout_ms_;

  mutable std::mutex m_;  // queues, events, allocations
  std::mutex pump_m_;     // one pumping thread at a time
  std::atomic<std::thread::id> pumper_{};
  std::vector<std::unique_ptr<stream_state>> streams_;  // [0]: the null stream
  int next_stream_id_ = 1;
  std::map<void*, std::shared_ptr<event_state>> events_;
  std::map<std::byte*, allocation> allocs_;

  std::atomic<std::size_t> host_syncs_{0};
  std::atomic<std::size_t> copies_{0};
  std::atomic<std::size_t> copied_bytes_{0};
  std::atomic<std::size_t> bad_frees_{0};
};

/// Settings of an emulated device communicator.
struct options {
  /// Deadline of the `wait()` of a collective over device tensors (and of a staged one). On it the
  /// communicator is aborted before `wait()` throws `timeout_error` (as the NCCL backend does: a
  /// collective whose peer never arrives would otherwise stay on the stream).
  std::chrono::milliseconds timeout = default_timeout;
};

namespace detail {

/// What a communicator and its pending steps and works share.
struct comm_state {
  comm_state(communicator_ref c, runtime& r, int ordinal, options o)
      : inner(c), rt(&r), where(device::cuda(ordinal)), rank(c.rank()), size(c.size()), opts(o) {}
  communicator_ref inner;
  runtime* rt;
  device_stream stream;
  device where;
  int rank;
  int size;
  options opts;
  std::atomic<bool> aborted{false};

  // Aborts the host communicator, never while a step is issuing or testing one of its collectives.
  void abort() noexcept {
    if (aborted.exchange(true)) return;
    try {
      rt->exclusive([this] { inner.abort(); });
    } catch (...) {  // could not lock: abort anyway
      inner.abort();
    }
  }
};

/// The work of a collective over device tensors: complete once the event recorded after it on
/// the communicator's stream completed ("completed on the device"); rethrows the stream's error.
class device_work final : public work_state {
 public:
  device_work(op_info info, std::shared_ptr<comm_state> state, device_event done)
      : work_state(info), state_(std::move(state)), done_(done) {}
  ~device_work() override { state_->rt->destroy_event(done_); }
  device_work(const device_work&) = delete;
  device_work& operator=(const device_work&) = delete;

  bool poll() override { return state_->rt->query(done_); }

  /// On the deadline the communicator is aborted (see `options::timeout`).
  bool wait_until(clock::time_point deadline) override {
    if (work_state::wait_until(deadline)) return true;
    state_->abort();
    return false;
  }

  /// Nothing to do: stream order, not this handle, protects the buffers (as with NCCL).
  void abandon() noexcept override {}

 private:
  std::shared_ptr<comm_state> state_;
  device_event done_;
};

/// `v`, tagged as the host memory it is.
[[nodiscard]] inline tensor_view as_host(tensor_view v) noexcept {
  v.where = device::host();
  return v;
}
[[nodiscard]] inline std::vector<tensor_view> as_host(std::span<const tensor_view> vs) {
  std::vector<tensor_view> out(vs.begin(), vs.end());
  for (tensor_view& v : out) v.where = device::host();
  return out;
}

}  // namespace detail

/// A device communicator over any host communicator: its collectives over device tensors are
/// enqueued on its own stream of `rt` and run the host communicator's collective when the stream
/// reaches them (the views re-tagged as host memory, which they are). Models
/// `device_communicator` (device_runtime.hpp states the contract) and `premul_sum_communicator`.
///
/// - Device tensors (all on `cuda(device_ordinal)`): the call returns at once; its work completes
///   when the collective completed on the stream; work enqueued on the stream after the call sees
///   the result without any host wait.
/// - Host tensors (all of them): staged through device memory on the stream (detail/host_staging.hpp)
///   and complete when the call returns: one `synchronize`, a host synchronisation.
/// - A call that mixes host and device tensors, or names another device, is a `usage_error`.
///
/// The host communicator must outlive this one and be used by nothing else meanwhile (its calls
/// are issued from whichever thread pumps the runtime, one at a time, in stream order); `rt` must
/// outlive this communicator and every work it returned. Use it from one thread, like the host
/// communicator.
class communicator {
 public:
  /// Rank `inner.rank()` of a device communicator over `inner`, on device `device_ordinal` of
  /// `rt`, with a new stream of `rt`.
  /// @throws usage_error if `inner` is itself a device communicator, or the ordinal is negative
  communicator(communicator_ref inner, runtime& rt, int device_ordinal, options opts = {})
      : s_(std::make_shared<detail::comm_state>(inner, rt, device_ordinal, opts)) {
    if (inner.has_device_queue()) {
      throw usage_error(s_->rank, "emulated_device::communicator",
                        "the host communicator is itself a device communicator");
    }
    if (device_ordinal < 0) {
      throw usage_error(s_->rank, "emulated_device::communicator",
                        "device ordinal " + std::to_string(device_ordinal) + " is negative");
    }
    s_->stream = rt.create_stream(s_->where);
  }
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  /// Takes over the communicator (its stream and pending work); the source may only be destroyed.
  communicator(communicator&& o) noexcept : s_(std::move(o.s_)), seq_(o.seq_) {}
  communicator& operator=(communicator&&) = delete;

  /// Drops the collectives still pending on its stream (their works fail with
  /// communication_error; their host collectives are abandoned) and destroys the stream.
  ~communicator() {
    if (!s_) return;
    try {
      s_->rt->fail_stream(s_->stream, std::make_exception_ptr(communication_error(
                                          s_->rank, "emulated_device::communicator",
                                          "the communicator was destroyed with this work pending on its stream")));
    } catch (...) {
    }
    s_->rt->destroy_stream(s_->stream);
  }

  /// This rank (the host communicator's).
  [[nodiscard]] int rank() const { return s_->rank; }
  /// Ranks of the host communicator.
  [[nodiscard]] int size() const { return s_->size; }
  /// The runtime, the communicator's stream, and `cuda(device_ordinal)`.
  [[nodiscard]] ddp::device_queue device_queue() const { return {s_->rt, s_->stream, s_->where}; }
  /// The host communicator.
  [[nodiscard]] communicator_ref inner() const noexcept { return s_->inner; }
  /// Number of collectives issued (device and staged).
  [[nodiscard]] std::uint64_t issued() const noexcept { return seq_; }

  /// Collective as in the `communicator` contract (see the class comment for host tensors).
  /// @throws usage_error for a tensor on another device, host and device tensors in one call, a
  ///   contract violation (backend_contract.hpp), or use after `abort()`; a staged call also
  ///   throws its collective's error
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    const bool host = host_call("allreduce", ts, op, -1);
    const op_info info = contract::check_allreduce(caller("allreduce", host), ts, op);
    auto issue = [op](communicator_ref c, std::span<const tensor_view> vs) { return c.allreduce(vs, op); };
    return host ? staged_list(info, ts, true, issue) : enqueue_list(info, ts, issue);
  }

  /// In-place sum in which every rank's floating-point values are first multiplied by `factor`
  /// (ddp/average.hpp's rule; integers are summed as they are): the host communicator's
  /// pre-multiplied sum when it has one, else a scaling in place on the stream and a sum.
  /// @throws as `allreduce`; usage_error if `factor` is not finite
  work allreduce_premul_sum(std::span<const tensor_view> ts, double factor) {
    const bool host = host_call("allreduce", ts, reduce_op::sum, -1);
    const op_info info = contract::check_allreduce(caller("allreduce", host), ts, reduce_op::sum);
    if (!std::isfinite(factor)) {
      throw usage_error(rank(), info.describe(), "the pre-multiplication factor is not finite");
    }
    auto issue = [factor](communicator_ref c, std::span<const tensor_view> vs) {
      if (c.has_premul_sum()) return c.allreduce_premul_sum(vs, factor);
      for (const tensor_view& v : vs) ddp::detail::scale_in_place(v.type, v.data, v.count, factor);
      return c.allreduce(vs, reduce_op::sum);
    };
    return host ? staged_list(info, ts, true, issue) : enqueue_list(info, ts, issue);
  }

  /// @copydoc allreduce
  work broadcast(std::span<const tensor_view> ts, int root) {
    const bool host = host_call("broadcast", ts, reduce_op::sum, root);
    const op_info info = contract::check_broadcast(caller("broadcast", host), ts, root);
    auto issue = [root](communicator_ref c, std::span<const tensor_view> vs) { return c.broadcast(vs, root); };
    return host ? staged_list(info, ts, rank() == root, issue) : enqueue_list(info, ts, issue);
  }

  /// @copydoc allreduce
  work allgather(tensor_view in, tensor_view out) {
    const tensor_view both[] = {in, out};
    const bool host = host_call("allgather", both, reduce_op::sum, -1);
    const op_info info = contract::check_allgather(caller("allgather", host), in, out);
    auto issue = [](communicator_ref c, tensor_view i, tensor_view o) { return c.allgather(i, o); };
    if (!host) return enqueue_pair(info, in, out, issue);
    ddp::detail::host_staging staging(device_queue());
    tensor_view din;
    tensor_view dout;
    if (contract::is_in_place_allgather(rank(), in, out)) {
      dout = staging.stage(out, /*copy_in=*/false);
      din = staging.stage(in, /*copy_in=*/true);  // its block of the output's copy
    } else {
      din = staging.stage(in, /*copy_in=*/true, /*copy_out=*/false);
      dout = staging.stage(out, /*copy_in=*/false);
    }
    staging.finish(enqueue_pair(info, din, dout, issue), info);
    return work::ready();
  }

  /// @copydoc allreduce
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    const tensor_view both[] = {in, out};
    const bool host = host_call("reduce_scatter", both, op, -1);
    const op_info info = contract::check_reduce_scatter(caller("reduce_scatter", host), in, out, op);
    auto issue = [op](communicator_ref c, tensor_view i, tensor_view o) { return c.reduce_scatter(i, o, op); };
    if (!host) return enqueue_pair(info, in, out, issue);
    ddp::detail::host_staging staging(device_queue());
    const tensor_view din = staging.stage(in, /*copy_in=*/true, /*copy_out=*/false);
    const tensor_view dout = staging.stage(out, /*copy_in=*/false);
    staging.finish(enqueue_pair(info, din, dout, issue), info);
    return work::ready();
  }

  /// A barrier enqueued on the stream (its work completes when the stream passed it).
  /// @throws usage_error after `abort()`
  work barrier() {
    const op_info info = contract::check_barrier(caller("barrier", false));
    return enqueue(info, [](communicator_ref c) { return c.barrier(); });
  }

  /// Aborts the host communicator: pending collectives fail with communication_error (those not
  /// issued yet when the stream reaches them); later calls throw usage_error.
  void abort() noexcept {
    if (s_) s_->abort();
  }

  /// Single-tensor conveniences over any tensor type.
  template <class T>
  requires ddp::tensor<T> || std::same_as<std::remove_cvref_t<T>, tensor_view> work allreduce(T& t, reduce_op op) {
    const tensor_view v = ddp::view(t);
    return allreduce(std::span<const tensor_view>(&v, 1), op);
  }
  /// @copydoc allreduce(T&, reduce_op)
  template <class T>
  requires ddp::tensor<T> || std::same_as<std::remove_cvref_t<T>, tensor_view> work broadcast(T& t, int root) {
    const tensor_view v = ddp::view(t);
    return broadcast(std::span<const tensor_view>(&v, 1), root);
  }

 private:
  static constexpr std::string_view backend_name = "the emulated device communicator";

  // The calling rank for the contract checks: host memory for a staged call, this device otherwise.
  [[nodiscard]] contract::caller caller(const char* name, bool host) const {
    if (s_->aborted.load()) throw usage_error(rank(), name, "communicator used after abort()");
    return {rank(), size(), seq_, s_->opts.timeout,
            host ? contract::memory_rule::host(backend_name)
                 : contract::memory_rule{s_->where, backend_name, "or host memory for every tensor of a call"}};
  }

  // True if every tensor of the call is host memory (staged), false if none is; a mix throws.
  [[nodiscard]] bool host_call(const char* name, std::span<const tensor_view> ts, reduce_op op, int root) const {
    std::size_t first_host = ts.size();
    std::size_t first_device = ts.size();
    for (std::size_t i = 0; i < ts.size(); ++i) {
      std::size_t& slot = ts[i].where.is_host() ? first_host : first_device;
      if (slot == ts.size()) slot = i;
    }
    if (first_host == ts.size()) return false;
    if (first_device == ts.size()) return true;
    if (s_->aborted.load()) throw usage_error(rank(), name, "communicator used after abort()");
    op_info info = contract::detail::start_info(caller(name, true), name, op, root);
    info.type = ts.front().type;
    for (const tensor_view& t : ts) info.count += t.count;
    const bool pair = std::string_view(name) == "allgather" || std::string_view(name) == "reduce_scatter";
    auto label = [&](std::size_t i) {
      return pair ? std::string(i == 0 ? "input" : "output") : "tensor #" + std::to_string(i);
    };
    throw usage_error(rank(), info.describe(),
                      "mixes host and device memory (" + label(first_host) + " on host, " + label(first_device) +
                          " on " + ts[first_device].where.str() + "): " + std::string(backend_name) +
                          " takes every tensor of a call on " + s_->where.str() +
                          ", or every one in host memory (staged through the device)");
  }

  // Enqueues the step that issues `issue(inner)` when the stream reaches it and is done when that
  // work completed; records an event after it. Returns at once.
  template <class Issue>
  work enqueue(const op_info& info, Issue issue) {
    struct pending {
      work inner;
      bool issued = false;
    };
    auto p = std::make_shared<pending>();
    s_->rt->enqueue(s_->stream, [s = s_, p, info, issue = std::move(issue)]() -> bool {
      if (!p->issued) {
        if (s->aborted.load()) {
          throw communication_error(info.rank, info.describe(),
                                    "the communicator was aborted before this collective ran on its stream");
        }
        p->issued = true;
        p->inner = issue(s->inner);
      }
      return p->inner.test();
    });
    ++seq_;
    const device_event done = s_->rt->create_event(s_->where);
    s_->rt->record(done, s_->stream);
    return work(std::make_unique<detail::device_work>(info, s_, done));
  }

  template <class Issue>
  work enqueue_list(const op_info& info, std::span<const tensor_view> ts, Issue issue) {
    return enqueue(info, [views = detail::as_host(ts), issue](communicator_ref c) {
      return issue(c, std::span<const tensor_view>(views));
    });
  }

  template <class Issue>
  work enqueue_pair(const op_info& info, tensor_view in, tensor_view out, Issue issue) {
    return enqueue(info, [in = detail::as_host(in), out = detail::as_host(out), issue](communicator_ref c) {
      return issue(c, in, out);
    });
  }

  // A call over host tensors: staged through device memory, complete on return.
  template <class Issue>
  work staged_list(const op_info& info, std::span<const tensor_view> ts, bool copy_in, Issue issue) {
    ddp::detail::host_staging staging(device_queue());
    std::vector<tensor_view> dev;
    dev.reserve(ts.size());
    for (const tensor_view& t : ts) dev.push_back(staging.stage(t, copy_in));
    staging.finish(enqueue_list(info, dev, issue), info);
    return work::ready();
  }

  std::shared_ptr<detail::comm_state> s_;
  std::uint64_t seq_ = 0;
};

static_assert(ddp::communicator<communicator>);
static_assert(ddp::device_communicator<communicator>);
static_assert(ddp::premul_sum_communicator<communicator>);

}  // namespace ddp::emulated_device
