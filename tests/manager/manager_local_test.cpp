// Fault-tolerant training over local replicas (threads), with injected crashes, stalls and
// replacements, as torchft tests its manager. After every run, every live replica holds
// parameters bit-identical to each other and to a fault-free replay of the committed batches.
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <string_view>
#include <thread>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/detail/describe_exception.hpp>
#include <ddp/groups.hpp>
#include <ddp/local.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/memory_store.hpp>

#include "../common/replicas.hpp"

using namespace std::chrono_literals;

namespace {

constexpr std::size_t dim = 6;
constexpr double lr = 0.1, beta = 0.9;

using replica_test::crash;
using replica_test::fault;
using replica_test::fault_point;
using replica_test::gradient;  // deterministic batch of replica `id` at step `s`

std::vector<double> initial_params(const std::string& id) { return replica_test::initial_params(id, dim); }

struct commit_record {
  std::int64_t step;
  std::vector<std::string> participants;
  bool operator==(const commit_record&) const = default;
};

struct replica_result {
  std::string id;
  bool crashed = false;
  std::string error;
  std::vector<double> params, momentum;
  std::int64_t step = 0, optimizer_steps = 0;
  std::vector<commit_record> commits;
  std::vector<std::string> events;
  std::map<std::uint64_t, std::vector<std::string>> quorums;  // generation -> members
};

struct cluster {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric;
  ddp::manager_options base = replica_test::scenario_options();  // several heal chunks: exercises spreading
  std::atomic<int>* routes_built = nullptr;                      // counts the heal routes built, if set
  explicit cluster(std::chrono::milliseconds collective_timeout)
      : fabric(ddp::local::options{.timeout = collective_timeout, .faults = {}}) {}

  // Trains until `steps` commits are done and the quorum has `want_members` members again, so
  // that a replacement or a stalled replica is not left behind by replicas that already finished.
  void run_replica(const std::string& id, fault f, std::int64_t steps, int want_members, replica_result& out,
                   std::chrono::milliseconds stall = 0ms) {
    out.id = id;
    std::vector<double> p = initial_params(id), g(dim, 0.0), mom(dim, 0.0);
    ddp::training_state state;
    state.add(p).add(mom);
    const auto opt_steps = state.add_scalar(0);
    auto opts = base;
    opts.replica_id = id;
    ddp::Manager m(
        store,
        [this](const ddp::quorum_info& q) {
          if (q.heal_source >= 0 && routes_built != nullptr) ++*routes_built;
          return ddp::any_communicator(fabric.connect(replica_test::fabric_key(q), q.rank, q.size));
        },
        state, opts);
    m.on_event([&](const ddp::manager_event& e) {
      out.events.push_back(e.text);
      if (e.what == ddp::manager_event::kind::quorum) out.quorums[m.generation()] = m.members();
    });
    ddp::Bucketer<ddp::bucketing::fixed> grads(m, {}, {.check_layout = false});
    grads.add(p, g);
    grads.register_comm_hook(m.comm_hook());
    grads.build();
    m.set_layout_fingerprint(grads.layout_fingerprint());
    bool fired = false;
    try {
      while (m.step() < steps || static_cast<int>(m.members().size()) < want_members) {
        if (m.step() > steps + 2000) throw std::runtime_error("the quorum never grew back to its expected size");
        m.start_quorum();
        std::this_thread::sleep_for(1ms);  // "compute": lets join requests arrive between steps
        const std::int64_t s = m.step();
        const bool hit = f.where != fault_point::none && s >= f.at_step && !fired;  // late joiners fire too
        fired = fired || hit;
        if (hit && f.where == fault_point::before_collective) throw crash{};
        const auto fresh_grad = gradient(id, s, p);
        std::copy(fresh_grad.begin(), fresh_grad.end(), g.begin());  // keep the registered storage
        if (hit && f.where == fault_point::stall) std::this_thread::sleep_for(stall);
        grads.mark_ready(0);  // launches the bucket's allreduce through the Manager
        if (hit && f.where == fault_point::during_collective) throw crash{};
        grads.finalize();
        if (hit && f.where == fault_point::after_collective) throw crash{};
        if (m.should_commit()) {
          for (std::size_t k = 0; k < dim; ++k) {
            mom[k] = beta * mom[k] + g[k];
            p[k] -= lr * mom[k];
          }
          ++state.scalar(opt_steps);
          out.commits.push_back({s, m.members()});
        }
      }
    } catch (const crash&) {
      out.crashed = true;
      m.abort();  // the process "dies": its communicator goes away, its heartbeat stops
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    out.params = p;
    out.momentum = mom;
    out.step = m.step();
    out.optimizer_steps = state.scalar(opt_steps);
  }
};

// Replays the committed batches without any fault: the parameters every live replica must hold.
std::vector<double> replay(const std::vector<commit_record>& commits, const std::string& first_rank0) {
  std::vector<double> p = initial_params(first_rank0), mom(dim, 0.0);
  for (const auto& c : commits) {
    // ddp's averaging rule (ddp/average.hpp): each participant's gradient times 1/n, then the
    // sum in rank order, as the local backend reduces.
    const double factor = 1.0 / static_cast<double>(c.participants.size());
    std::vector<double> avg(dim, 0.0);
    bool first = true;
    for (const auto& id : c.participants) {
      const auto g = gradient(id, c.step, p);
      for (std::size_t k = 0; k < dim; ++k) avg[k] = first ? g[k] * factor : avg[k] + g[k] * factor;
      first = false;
    }
    for (std::size_t k = 0; k < dim; ++k) {
      mom[k] = beta * mom[k] + avg[k];
      p[k] -= lr * mom[k];
    }
  }
  return p;
}

struct scenario_outcome {
  std::vector<replica_result> results;
};

// Runs replicas (and replacements that start after `replacement_delay`) to `steps` commits.
scenario_outcome run_scenario(int replicas, std::int64_t steps, const std::map<int, fault>& faults,
                              const std::vector<std::string>& replacements, std::chrono::milliseconds stall = 0ms,
                              std::chrono::milliseconds collective_timeout = 1000ms) {
  return {replica_test::run_scenario<cluster, replica_result>(replicas, steps, faults, replacements, stall,
                                                              collective_timeout)};
}

// The checks every scenario must pass.
void check_outcome(const scenario_outcome& o, std::int64_t steps, std::size_t expected_live) {
  std::vector<const replica_result*> live;
  const replica_result* longest = nullptr;
  INFO(replica_test::history(o.results));
  for (const auto& r : o.results) {
    INFO(r.id << ": " << r.error);
    REQUIRE(r.error.empty());
    if (r.crashed) continue;
    live.push_back(&r);
    if (!longest || r.commits.size() > longest->commits.size()) longest = &r;
  }
  REQUIRE(live.size() == expected_live);
  // Steps 0..n-1 each committed exactly once, in order, in the longest-lived log (n >= steps: the
  // survivors keep training until the replacements are in).
  const auto total = static_cast<std::int64_t>(longest->commits.size());
  REQUIRE(total >= steps);
  for (std::int64_t s = 0; s < total; ++s) CHECK(longest->commits[static_cast<std::size_t>(s)].step == s);
  // No step was applied with different participants on different replicas (crashed ones included).
  std::map<std::int64_t, commit_record> by_step;
  for (const auto& r : o.results) {
    for (const auto& c : r.commits) {
      auto [it, fresh] = by_step.emplace(c.step, c);
      CHECK(it->second == c);
    }
  }
  // The first quorum of the job synchronised everyone to its rank 0's initial parameters.
  std::map<std::uint64_t, std::vector<std::string>> quorums;
  for (const auto& r : o.results) quorums.insert(r.quorums.begin(), r.quorums.end());
  REQUIRE_FALSE(quorums.empty());
  // Bit-identical to each other and to the fault-free replay.
  const auto want = replay(longest->commits, quorums.begin()->second.front());
  for (const auto* r : live) {
    INFO("replica " << r->id);
    CHECK(r->step == total);
    CHECK(r->optimizer_steps == live.front()->optimizer_steps);
    CHECK(r->params == live.front()->params);
    CHECK(r->momentum == live.front()->momentum);
    CHECK(r->params == want);
  }
}

}  // namespace

TEST_CASE("Manager: fault-free training over 3 local replicas", "[local][manager]") {
  const auto o = run_scenario(3, 6, {}, {});
  check_outcome(o, 6, 3);
  for (const auto& r : o.results) CHECK(r.events.size() >= 1);  // each saw at least its first quorum
}

TEST_CASE("Manager: a replica crashes before, during or after its gradient collective; a replacement heals",
          "[local][manager][fault]") {
  std::mt19937 rng(20261122);
  for (int run = 0; run < 20; ++run) {
    const auto where = static_cast<fault_point>(1 + run % 3);
    const int victim = static_cast<int>(rng() % 3);
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 4);
    INFO("run " << run << ": replica r" << victim << " crashes at step " << at << ", point "
                << static_cast<int>(where));
    const auto o = run_scenario(3, 8, {{victim, {where, at}}}, {"r9"});
    check_outcome(o, 8, 3);
    bool healed = false;
    for (const auto& e : o.results.back().events) healed = healed || e.find("healed to step") != std::string::npos;
    CHECK(healed);
  }
}

TEST_CASE("Manager: over source routes, a replacement heals from both survivors at once", "[local][manager][fault]") {
  std::mt19937 rng(20261127);
  for (int run = 0; run < 10; ++run) {
    const auto where = static_cast<fault_point>(1 + run % 3);
    const int victim = static_cast<int>(rng() % 3);
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 4);
    INFO("run " << run << ": replica r" << victim << " crashes at step " << at << ", point "
                << static_cast<int>(where));
    std::atomic<int> routes{0};
    const scenario_outcome o{replica_test::run_scenario<cluster, replica_result>(
        3, 8, {{victim, {where, at}}}, {"r9"}, 0ms, 1000ms, [&](cluster& c) {
          c.base.heal_over = ddp::heal_transport::source_routes;
          c.routes_built = &routes;
        })};
    check_outcome(o, 8, 3);
    // From both survivors, or from all three when the replacement arrived before the crash (a
    // loaded machine: the crash at step 1-4 came after the replacement's start, 150 ms in).
    bool healed_from_several = false;
    for (const auto& e : o.results.back().events) {
      healed_from_several = healed_from_several || e.find("from 2 up-to-date replica(s)") != std::string::npos ||
                            e.find("from 3 up-to-date replica(s)") != std::string::npos;
    }
    CHECK(healed_from_several);
    CHECK(routes.load() >= 4);  // a heal from 2 sources: 2 routes on the receiver, 1 on each source
  }
}

TEST_CASE("Manager: two replicas crash in the same step", "[local][manager][fault]") {
  std::mt19937 rng(7);
  for (int run = 0; run < 20; ++run) {
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 4);
    const auto where = static_cast<fault_point>(1 + rng() % 3);
    INFO("run " << run << " at step " << at);
    const auto o = run_scenario(4, 7, {{1, {where, at}}, {3, {where, at}}}, {});
    check_outcome(o, 7, 2);
  }
}

TEST_CASE("Manager: a replica stalls past the collective timeout, then catches up", "[local][manager][fault]") {
  std::mt19937 rng(11);
  for (int run = 0; run < 20; ++run) {
    const int victim = static_cast<int>(rng() % 3);
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 3);
    INFO("run " << run << ": r" << victim << " stalls at step " << at);
    const auto o = run_scenario(3, 6, {{victim, {fault_point::stall, at}}}, {}, 400ms, 200ms);
    check_outcome(o, 6, 3);
  }
}

namespace {

// Forwards to a communicator and counts its broadcasts in `*broadcasts` (any_communicator owns a
// copy of it, so the count lives outside).
struct broadcast_counter {
  ddp::communicator_ref inner;
  std::size_t* broadcasts;
  [[nodiscard]] int rank() const { return inner.rank(); }
  [[nodiscard]] int size() const { return inner.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) { return inner.allreduce(ts, op); }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) {
    ++*broadcasts;
    return inner.broadcast(ts, root);
  }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) { return inner.allgather(in, out); }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    return inner.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return inner.barrier(); }
  void abort() noexcept { inner.abort(); }
};

}  // namespace

TEST_CASE("Manager healing: small tensors travel coalesced, large ones in slices, every byte arrives",
          "[local][manager]") {
  // Ranks 0 and 2 hold step 7's state, rank 1 zeros: 300 tensors of 0 to 3 elements (i8, f32,
  // f64) and one of 1000 f32, in 64-byte transfers.
  constexpr int ranks = 3;
  constexpr std::size_t chunk = 64;
  std::vector<std::size_t> broadcasts(ranks, 0), moved(ranks, 0);
  std::vector<int> wrong(ranks, -1);
  std::size_t small_bytes = 0;
  ddp::local::run(ranks, [&](ddp::local::communicator& c) {
    const int r = c.rank();
    const bool source = r != 1;
    std::vector<std::vector<std::int8_t>> i8s;
    std::vector<std::vector<float>> f32s;
    std::vector<std::vector<double>> f64s;
    std::vector<ddp::tensor_view> tensors;
    std::size_t bytes = 0;
    i8s.reserve(100);
    f32s.reserve(101);
    f64s.reserve(100);
    for (std::size_t k = 0; k < 300; ++k) {
      const std::size_t n = k % 4;
      const double v = source ? static_cast<double>(k) + 0.5 : 0.0;
      if (k % 3 == 0) tensors.push_back(ddp::view(i8s.emplace_back(n, static_cast<std::int8_t>(source ? k % 100 : 0))));
      if (k % 3 == 1) tensors.push_back(ddp::view(f32s.emplace_back(n, static_cast<float>(v))));
      if (k % 3 == 2) tensors.push_back(ddp::view(f64s.emplace_back(n, v)));
      bytes += tensors.back().bytes();
    }
    if (r == 0) small_bytes = bytes;
    tensors.push_back(ddp::view(f32s.emplace_back(1000, source ? 3.25f : 0.0f)));
    std::vector<std::int64_t> scalars{source ? 11 : 0, source ? -4 : 0};
    const ddp::detail::state_view state{tensors, scalars};
    ddp::any_communicator comm{broadcast_counter{ddp::communicator_ref(c), &broadcasts[static_cast<std::size_t>(r)]}};
    ddp::progress_meter meter(nullptr, "heal test", r);
    moved[static_cast<std::size_t>(r)] = ddp::detail::broadcast_state(comm, state, {0, 2}, 7, chunk, meter, r);
    // Rank 1 now holds what the sources hold.
    int bad = 0;
    for (std::size_t k = 0; k < 300; ++k) {
      const double v = static_cast<double>(k) + 0.5;
      if (k % 3 == 0) bad += i8s[k / 3] != std::vector<std::int8_t>(k % 4, static_cast<std::int8_t>(k % 100));
      if (k % 3 == 1) bad += f32s[k / 3] != std::vector<float>(k % 4, static_cast<float>(v));
      if (k % 3 == 2) bad += f64s[k / 3] != std::vector<double>(k % 4, v);
    }
    bad += f32s.back() != std::vector<float>(1000, 3.25f);
    bad += scalars != std::vector<std::int64_t>{11, -4};
    wrong[static_cast<std::size_t>(r)] = bad;
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(wrong[static_cast<std::size_t>(r)] == 0);
    CHECK(moved[static_cast<std::size_t>(r)] == small_bytes + 4000);
    // 4000 bytes in 63 slices, the small tensors in transfers of up to 64 bytes (each at least
    // 40 full, as no small tensor has more than 24 bytes), and the scalars: far fewer than one
    // broadcast per tensor.
    CHECK(broadcasts[static_cast<std::size_t>(r)] <= 63 + (small_bytes + 39) / 40 + 1 + 1);
    CHECK(broadcasts[static_cast<std::size_t>(r)] < 150);
  }
}

TEST_CASE("Manager healing: the state hash is XXH64, taken as the transfers land, and names a differing member",
          "[local][manager]") {
  if constexpr (std::endian::native == std::endian::little) {  // XXH64's published values
    CHECK(ddp::detail::xxh64({}) == 0xEF46DB3751D8E999ull);
    const std::string_view text = "Nobody inspects the spammish repetition";  // 39 bytes: lanes and every tail
    CHECK(ddp::detail::xxh64(std::as_bytes(std::span(text.data(), text.size()))) == 0xFBCEA83C8A378BF1ull);
  }
  // Ranks 0 and 2 hold step 3's state, rank 1 zeros: a tensor sliced into 5 transfers and 40 small
  // ones coalesced. Every member's hash taken as the transfers land equals a later pass over its
  // state; after one byte of rank 1 changes, the pass differs and the check names rank 1.
  constexpr int ranks = 3;
  constexpr std::size_t chunk = 256;
  const std::vector<std::string> members{"a", "b", "c"};
  std::vector<std::uint64_t> landed(ranks), pass(ranks), corrupted(ranks);
  std::vector<std::string> errors(ranks);
  ddp::local::run(ranks, [&](ddp::local::communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const bool source = r != 1;
    std::vector<float> big(300, source ? 1.5f : 0.0f);
    std::vector<std::vector<std::int32_t>> small(40, std::vector<std::int32_t>(3, source ? 7 : 0));
    std::vector<ddp::tensor_view> tensors{ddp::view(big)};
    for (auto& s : small) tensors.push_back(ddp::view(s));
    std::vector<std::int64_t> scalars{source ? 9 : 0};
    const ddp::detail::state_view state{tensors, scalars};
    ddp::any_communicator comm{ddp::communicator_ref(c)};
    ddp::progress_meter meter(nullptr, "heal test", c.rank());
    const ddp::detail::healed_state healed = ddp::detail::heal_state(comm, state, {0, 2}, 3, chunk, meter, c.rank());
    landed[r] = healed.hash;
    pass[r] = ddp::detail::state_hash(state, 3, comm, chunk);
    ddp::detail::check_same_state(comm, healed.hash, members, c.rank());  // all alike: no error
    if (r == 1) small[20][1] ^= 0x100;
    corrupted[r] = ddp::detail::state_hash(state, 3, comm, chunk);
    try {
      ddp::detail::check_same_state(comm, state, 3, chunk, members, c.rank());
    } catch (const ddp::communication_error& e) {
      errors[r] = e.what();
    }
  });
  for (std::size_t r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(landed[r] == landed[0]);
    CHECK(pass[r] == landed[r]);
    CHECK(errors[r].find(r == 1 ? "replica a holds a different state" : "replica b holds a different state") !=
          std::string::npos);
  }
  CHECK(corrupted[1] != corrupted[0]);
  CHECK(corrupted[0] == landed[0]);
}

TEST_CASE("Manager: timing options that cannot work are refused, naming what to raise", "[local][manager][timing]") {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric{ddp::local::options{.timeout = 3000ms, .faults = {}}};
  std::vector<double> p(4, 0.0);
  ddp::training_state state;
  state.add(p);
  const ddp::communicator_factory factory = [&](const ddp::quorum_info& q) {
    return ddp::any_communicator(fabric.connect(replica_test::fabric_key(q), q.rank, q.size));
  };
  const auto refused = [&](ddp::manager_options o) -> std::string {
    try {
      ddp::Manager m(store, factory, state, o);
    } catch (const ddp::usage_error& e) {
      return e.what();
    }
    return "";
  };
  auto o = ddp::manager_options::fast_failover("r0");
  CHECK(refused(o).empty());  // the preset is consistent
  CHECK(o.step_timeout == 5000ms);
  auto hb = o;
  hb.heartbeat_timeout = hb.heartbeat_interval;  // a live replica would look dead between heartbeats
  CHECK_THAT(refused(hb), Catch::Contains("heartbeat_timeout") && Catch::Contains("raise heartbeat_timeout"));
  auto q = o;
  q.quorum_timeout = q.heartbeat_timeout;  // no quorum could form without a hung member in time
  CHECK_THAT(refused(q), Catch::Contains("quorum_timeout") && Catch::Contains("raise quorum_timeout"));
  auto s = o;
  s.step_timeout = 0ms;
  CHECK_THAT(refused(s), Catch::Contains("step_timeout"));

  // A replica group's inner communicator (3 s here) must outlast a follower's longest wait.
  auto inner = fabric.connect("inner", 0, 1);
  auto g = o;  // max(quorum_timeout 30 s, step_timeout 5 s + heartbeat_timeout 2 s) > 3 s
  try {
    ddp::GroupManager<ddp::local::communicator> gm(inner, store, factory, state, ddp::group_state::replicated, g);
    FAIL("accepted an inner timeout shorter than a follower's wait");
  } catch (const ddp::usage_error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("inner communicator's timeout (3000 ms)") &&
                                          Catch::Contains("30000 ms") && Catch::Contains("raise"));
  }
  g.quorum_timeout = 2900ms;
  g.step_timeout = 900ms;
  CHECK_NOTHROW(
      ddp::GroupManager<ddp::local::communicator>(inner, store, factory, state, ddp::group_state::replicated, g));
}

TEST_CASE("Manager: a collective that outlives the step's deadline fails the step, named, without a throw",
          "[local][manager][timing]") {
  // Two replicas; r1 never issues the step's allreduce (hung). r0's allreduce, only ever tested in
  // a loop (as a reducer polls), fails at the step deadline: the step fails, the error names the
  // collective and the deadline, and the communicator's own 60 s timeout plays no part.
  ddp::stores::memory_store store;
  ddp::local::fabric fabric{ddp::local::options{.timeout = 60000ms, .faults = {}}};
  std::atomic<bool> r1_done{false};
  std::string error;
  double waited_ms = 0;
  const auto run = [&](int id) {
    std::vector<double> p(4, 1.0);
    ddp::training_state state;
    state.add(p);
    auto o = replica_test::scenario_options();
    o.replica_id = "r" + std::to_string(id);
    o.min_replicas = 2;
    o.step_timeout = 300ms;
    ddp::Manager m(
        store,
        [&](const ddp::quorum_info& q) {
          return ddp::any_communicator(fabric.connect(replica_test::fabric_key(q), q.rank, q.size));
        },
        state, o);
    m.start_quorum();
    if (id == 1) {  // hung: holds its communicator open, issues nothing
      while (!r1_done) std::this_thread::sleep_for(1ms);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    const std::vector<ddp::tensor_view> views{ddp::view(p)};
    ddp::work w = m.allreduce(views, ddp::reduce_op::sum);
    while (!w.test()) std::this_thread::sleep_for(100us);
    waited_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    CHECK(m.failed());
    error = ddp::detail::describe_exception(m.error());
    r1_done = true;
  };
  std::thread t1([&] { run(1); });
  run(0);
  t1.join();
  INFO(error);
  CHECK(waited_ms >= 290);
  CHECK(waited_ms < 5000);
  CHECK_THAT(error, Catch::Contains("allreduce") && Catch::Contains("step_timeout 300 ms") &&
                        Catch::Contains("waited") && !Catch::Contains("within the 0 ms"));
}
