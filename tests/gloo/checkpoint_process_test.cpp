// A whole job resumed from checkpoints into a fresh store (issue #46), over gloo processes: three
// replicas train under a Manager, the quorum's rank 0 saves a checkpoint every 5 steps, the job
// stops at step 17; a new job (a fresh store) loads the newest valid checkpoint, resumes its step,
// and trains on to step 30. Its state at every step from the checkpoint on has the same hash as an
// uninterrupted job's; a replica that finds no checkpoint (the quorum's rank 0) heals from the
// others; a truncated newest checkpoint is skipped for the one before.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/checkpoint.hpp>
#include <ddp/gloo.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/file_store.hpp>

#include "manager_trainer.hpp"
#include "process_group.hpp"

using namespace std::chrono_literals;
namespace fs = std::filesystem;
namespace st = ddp::stores;
using gloo_test::temp_dir;

namespace {

constexpr std::size_t dim = gloo_test::dim;
constexpr std::int64_t every = 5;

struct run_plan {
  fs::path store;        // the Manager's store (a fresh one per job)
  fs::path records;      // commits ("c/<step>/<id>") and what each replica resumed from
  fs::path checkpoints;  // shared by the job's replicas (or one replica's own)
  std::int64_t stop_after = 0;
  bool resume = false;
};

void train(const run_plan& plan, const std::string& id) {
  st::file_store store(plan.store);
  st::file_store records(plan.records);
  std::vector<double> p(dim), g(dim, 0.0), mom(dim, 0.0);
  for (std::size_t k = 0; k < dim; ++k) p[k] = static_cast<double>(std::hash<std::string>{}(id) % 13) + 0.1 * k;
  ddp::training_state state;
  state.add(p).add(mom);
  ddp::manager_options opts;
  opts.replica_id = id;
  opts.min_replicas = 3;  // every step by all three: the same bits as the uninterrupted job
  opts.heartbeat_interval = 20ms;
  opts.heartbeat_timeout = 600ms;
  opts.settle = 20ms;
  opts.quorum_timeout = 20s;
  opts.step_timeout = 5s;
  opts.heal_chunk_bytes = 128;
  opts.progress = {};
  ddp::gloo::options go;
  go.timeout = 3s;
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        return ddp::any_communicator(ddp::gloo::communicator(q.store, q.rank, q.size, go));
      },
      state, opts);
  ddp::checkpoint_dir checkpoints(plan.checkpoints, 2);
  if (plan.resume) {
    std::string resumed = "none";
    if (const auto got = checkpoints.load_latest(state)) {
      m.resume(got->step);
      resumed = std::to_string(got->step);
      for (const auto& s : got->skipped) resumed += " skipped " + s;
    }
    records.set("resumed/" + id, ddp::as_bytes(resumed));
  }
  ddp::Bucketer<ddp::bucketing::fixed> grads(m);
  grads.add(p, g);
  m.attach(grads);
  for (int guard = 0;; ++guard) {
    CHILD_CHECK(guard < 500, "no end after 500 steps");
    m.start_quorum();
    const std::int64_t s = m.step();
    for (std::size_t k = 0; k < dim; ++k) g[k] = p[k] - std::sin(0.3 * static_cast<double>(s) + static_cast<double>(k));
    grads.mark_ready(0);
    grads.finalize();
    if (!m.should_commit()) continue;
    gloo_test::apply_step(p, mom, g);
    gloo_test::record_commit(records, s, id, m.members(), p, mom);
    if (m.rank() == 0 && m.step() % every == 0) checkpoints.save(m.step(), state);  // one writer per step
    if (m.step() >= plan.stop_after) return;
  }
}

void run_job(const run_plan& plan, const fs::path& own_checkpoints_of_a = {}) {
  gloo_test::process_group group(3, [&](int rank, const gloo_test::reporter&) {
    run_plan mine = plan;
    if (rank == 0 && !own_checkpoints_of_a.empty()) mine.checkpoints = own_checkpoints_of_a;
    train(mine, std::string(1, static_cast<char>('a' + rank)));
  });
  const auto outs = group.wait_all(60s);
  INFO(gloo_test::describe_all(outs));
  for (const auto& o : outs) REQUIRE(o.ok());
}

std::string at(const fs::path& records, std::int64_t step, const std::string& id) {
  return gloo_test::text_of(st::file_store(records).get("c/" + std::to_string(step) + "/" + id));
}

// An uninterrupted job to `last`; then a job stopped at `stop`, `damage` done to its checkpoints,
// and a job resumed from them; the resumed job's commits from `expected_resume` on must match the
// uninterrupted one's. Replica a of the resumed job (its quorum's rank 0) finds no checkpoint: the
// members at the highest step start the job, not rank 0.
void check_resume(std::int64_t stop, std::int64_t last, std::int64_t expected_resume,
                  const std::function<void(ddp::checkpoint_dir&)>& damage) {
  temp_dir dir("checkpoint");
  const fs::path root = dir.path();
  for (const char* d : {"ref-store", "ref-records", "ref-ckpt", "s1", "r1", "ckpt", "s2", "r2", "a-own"}) {
    fs::create_directories(root / d);
  }
  run_job({root / "ref-store", root / "ref-records", root / "ref-ckpt", last, false});
  run_job({root / "s1", root / "r1", root / "ckpt", stop, false});
  ddp::checkpoint_dir ckpt(root / "ckpt");
  damage(ckpt);
  run_job({root / "s2", root / "r2", root / "ckpt", last, true}, root / "a-own");
  st::file_store r2(root / "r2");
  INFO("b resumed: " << gloo_test::text_of(r2.get("resumed/b")));
  CHECK(gloo_test::text_of(r2.get("resumed/b")).rfind(std::to_string(expected_resume), 0) == 0);
  CHECK(gloo_test::text_of(r2.get("resumed/c")).rfind(std::to_string(expected_resume), 0) == 0);
  CHECK(gloo_test::text_of(r2.get("resumed/a")) == "none");
  for (std::int64_t s = 0; s < expected_resume; ++s) {  // no step before the checkpoint's was trained again
    for (const std::string id : {"a", "b", "c"}) CHECK(at(root / "r2", s, id).empty());
  }  // the first step of the new job is the checkpoint's
  for (std::int64_t s = expected_resume; s < last; ++s) {
    INFO("step " << s);
    const std::string ref = at(root / "ref-records", s, "a");
    REQUIRE(!ref.empty());
    for (const std::string id : {"a", "b", "c"}) CHECK(at(root / "r2", s, id) == ref);
  }
}

}  // namespace

TEST_CASE("checkpoint: a whole job resumed into a fresh store continues from the newest checkpoint, bit-identical",
          "[checkpoint][file]") {
  check_resume(17, 30, 15, [](ddp::checkpoint_dir& c) {
    const auto all = c.list();
    REQUIRE(all.size() == 2);  // keep = 2: steps 15 and 10
    CHECK(all[0].first == 15);
  });
}

TEST_CASE("checkpoint: a truncated newest checkpoint is skipped; the job resumes from the one before",
          "[checkpoint][file]") {
  check_resume(17, 30, 10, [](ddp::checkpoint_dir& c) {
    const fs::path newest = c.file_of(15);
    fs::resize_file(newest, fs::file_size(newest) / 2);
  });
}
