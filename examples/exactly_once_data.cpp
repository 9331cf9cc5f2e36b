// Exactly-once data while replicas come and go.
//
//   ./exactly_once_data          (three replicas as threads of this process; no mpirun)
//
// Three replicas train under a fault-tolerance Manager (local backend, in-memory store). Each step
// they take their share of the global batch (6 samples) from a global_batch_sampler and reduce
// their micro-batch gradients with a ReproducibleReducer. Replica r1 dies in step 3, after
// computing its gradients and before its collective; the step does not commit, its samples go
// back, the survivors redo it as two (reusing the gradients they had computed where their new
// share allows), and a replacement r3, started as soon as r1 died, joins, heals (parameters,
// momentum and the sampler's cursor) and takes a share. Everyone trains until 16 steps are
// committed and the replacement is in. The program records the sample ids of every committed step and
// prints whether every sample of every epoch was trained on exactly once.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <ddp/data/global_batch_sampler.hpp>
#include <ddp/local.hpp>
#include <ddp/manager.hpp>
#include <ddp/reproducible.hpp>
#include <ddp/stores/memory_store.hpp>

using namespace std::chrono_literals;

namespace {

constexpr std::size_t dim = 4;
constexpr std::int64_t steps = 16;  // two epochs of 48 samples in global batches of 6
const ddp::data::sampler_options data{.dataset_size = 48, .global_batch = 6, .micro_batch = 1, .seed = 7};

struct ledger {
  std::mutex m;
  std::map<std::int64_t, std::map<int, std::vector<std::uint64_t>>> shares;  // step -> rank -> sample ids
  std::map<std::string, std::vector<double>> final_params;
  std::size_t reused = 0;
  std::atomic<bool> died{false};
};

struct crash {};

void replica(const std::string& id, bool dies, ddp::stores::memory_store& store, ddp::local::fabric& fabric,
             ledger& book) {
  std::vector<double> w(dim, 0.0), mom(dim, 0.0), g(dim, 0.0);
  ddp::training_state state;
  state.add(w).add(mom);
  ddp::data::global_batch_sampler sampler(data, state);  // the cursor is part of the healed state
  ddp::manager_options opts;
  opts.replica_id = id;
  opts.min_replicas = 2;
  opts.heartbeat_interval = 10ms;
  opts.heartbeat_timeout = 400ms;
  opts.settle = 60ms;
  ddp::Manager m(
      store,
      [&fabric](const ddp::quorum_info& q) {
        return ddp::any_communicator(fabric.connect("g" + std::to_string(q.generation), q.rank, q.size));
      },
      state, opts);
  m.on_event([&](const ddp::manager_event& e) {
    if (e.what != ddp::manager_event::kind::error) std::printf("  %s: %s\n", id.c_str(), e.text.c_str());
  });
  ddp::ReproducibleReducer red(m, sampler.micro_batches(), {.check_layout = false, .reuse_after_failure = true});
  red.add(g);
  red.build();
  m.set_layout_fingerprint(red.layout_fingerprint());
  try {
    while (m.step() < steps || m.members().size() < 3) {
      m.start_quorum();
      std::this_thread::sleep_for(2ms);
      const std::int64_t s = m.step();
      red.begin(sampler.cursor());  // a retry of the same step reuses what this replica computed
      for (std::size_t j : red.pending()) {
        const auto xs = sampler.micro_batch(j);  // sample ids
        for (std::size_t k = 0; k < dim; ++k) {
          g[k] = 0;
          for (auto x : xs) g[k] += w[k] - std::cos(0.1 * static_cast<double>(x) + static_cast<double>(k));
          g[k] /= static_cast<double>(xs.size());
        }
        red.accumulate(j);
      }
      if (dies && s == 3) throw crash{};
      red.finalize();
      const auto mine = sampler.samples(m.rank(), m.size());
      if (m.should_commit()) {
        for (std::size_t k = 0; k < dim; ++k) {
          mom[k] = 0.9 * mom[k] + g[k];
          w[k] -= 0.1 * mom[k];
        }
        sampler.commit();
        std::lock_guard lk(book.m);
        book.shares[s][m.rank()] = mine;
        book.reused += red.last_step().reused;
      }
    }
  } catch (const crash&) {
    std::printf("  %s: dies in step 3 before its gradient collective\n", id.c_str());
    m.abort();
    book.died = true;  // the "launcher" starts a replacement
    return;
  }
  std::lock_guard lk(book.m);
  book.final_params[id] = w;
}

}  // namespace

int main() {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric(ddp::local::options{.timeout = std::chrono::milliseconds(2000), .faults = {}});
  ledger book;
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r) {
    ts.emplace_back([&, r] { replica("r" + std::to_string(r), r == 1, store, fabric, book); });
  }
  while (!book.died) std::this_thread::sleep_for(1ms);
  ts.emplace_back([&] { replica("r3", false, store, fabric, book); });
  for (auto& t : ts) t.join();

  // Every committed step: shares disjoint, B samples; every epoch: every sample exactly once.
  bool constant = true;
  std::vector<std::uint64_t> stream;
  for (const auto& [s, by_rank] : book.shares) {
    std::size_t n = 0;
    for (const auto& [r, ids] : by_rank) {
      n += ids.size();
      stream.insert(stream.end(), ids.begin(), ids.end());
    }
    constant = constant && n == data.global_batch;
  }
  // Steps 0..T-1 each committed once (map keys), each completed epoch holds every sample once,
  // the epoch in progress none twice.
  bool exactly_once = book.shares.size() >= static_cast<std::size_t>(steps) &&
                      book.shares.rbegin()->first + 1 == static_cast<std::int64_t>(book.shares.size());
  for (std::size_t e = 0; e * data.dataset_size < stream.size(); ++e) {
    const std::size_t end = std::min(stream.size(), (e + 1) * data.dataset_size);
    const std::set<std::uint64_t> ids(stream.begin() + static_cast<std::ptrdiff_t>(e * data.dataset_size),
                                      stream.begin() + static_cast<std::ptrdiff_t>(end));
    exactly_once = exactly_once && ids.size() == end - e * data.dataset_size;
  }
  bool identical = book.final_params.size() == 3;
  for (const auto& [id, w] : book.final_params) identical = identical && w == book.final_params.begin()->second;
  std::printf("committed steps: %zu, global batch %llu at every one: %s\n", book.shares.size(),
              static_cast<unsigned long long>(data.global_batch), constant ? "yes" : "NO");
  std::printf("micro-batches reused from the failed step: %zu\n", book.reused);
  std::printf("every sample of %zu complete epochs exactly once, none twice in the next: %s\n",
              stream.size() / data.dataset_size, exactly_once ? "yes" : "NO");
  std::printf("parameters identical on the 3 live replicas: %s\n", identical ? "yes" : "NO");
  return constant && exactly_once && identical ? 0 : 1;
}
