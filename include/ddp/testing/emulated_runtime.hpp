#pragma once
/// @file testing/emulated_runtime.hpp
/// @brief `ddp::emulated_device::runtime`: the device runtime emulated on the host (the model:
/// docs/gpu-training.md, "Testing without a GPU: the emulated device").

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

#include <ddp/device.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>
#include <ddp/testing/emulated_host_side.hpp>

namespace ddp::emulated_device {

/// The device runtime emulated on the host (docs/gpu-training.md). Thread-safe: any thread may
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

  // ---- host staging (emulated_host_side.hpp): gates are steps that wait for a flag ------------

  [[nodiscard]] void* allocate_host(std::size_t bytes) override { return host_.allocate(bytes); }
  /// An unknown pointer is counted by `bad_frees()` and left alone.
  void deallocate_host(void* memory) noexcept override {
    if (!host_.deallocate(memory)) bad_frees_.fetch_add(1);
  }
  [[nodiscard]] device_gate create_gate() override { return host_.create_gate(); }
  /// @throws usage_error for a gate that is not live
  void wait_gate(device_stream stream, device_gate gate) override {
    enqueue_step(stream, "emulated_device::wait_gate",
                 step::run_step([g = host_.flag(gate, rank_)] { return g->load(); }));
  }
  void open_gate(device_gate gate) noexcept override { host_.open_gate(gate); }
  void destroy_gate(device_gate gate) noexcept override { host_.destroy_gate(gate); }
  /// Gates, and host allocations, not destroyed or freed yet.
  [[nodiscard]] const detail::host_side& host_side() const noexcept { return host_; }

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
  detail::host_side host_{alignment};

  std::atomic<std::size_t> host_syncs_{0};
  std::atomic<std::size_t> copies_{0};
  std::atomic<std::size_t> copied_bytes_{0};
  std::atomic<std::size_t> bad_frees_{0};
};

}  // namespace ddp::emulated_device
