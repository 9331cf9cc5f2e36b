// The job secret's fail-closed rule across test hosts (issue #44; docs/security.md, "Pair
// authentication"), run by `ddp-run --hosts 2` (one rank per host, each in its host's network
// namespace and with its own host name): a gloo communicator on the hosts' own interface
// - without a secret refuses to start on every rank, saying it spans two hosts and how to set one;
// - without a secret but with insecure_no_secret runs;
// - with the job's secret (ddp-run's DDP_JOB_SECRET) runs.
// The ranks meet through a file store in /tmp (the hosts share the file system, not the network).
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/gloo.hpp>
#include <ddp/job_secret.hpp>
#include <ddp/stores/file_store.hpp>

using namespace std::chrono_literals;

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

int env_int(const char* name) { return std::atoi(env(name).c_str()); }

float reduce_once(ddp::gloo::communicator& c) {
  std::vector<float> v(1024, 1.0f);
  ddp::communicator_ref(c).allreduce(v, ddp::reduce_op::sum).wait();
  return v.back();
}

}  // namespace

TEST_CASE("gloo secret across hosts: none is refused on every rank, opted out or set it runs", "[hosts][auth]") {
  const std::string cluster = env("DDP_HOSTS_ID");
  REQUIRE_FALSE(cluster.empty());  // run by ddp-run --hosts
  const int rank = env_int("OMPI_COMM_WORLD_RANK"), size = env_int("OMPI_COMM_WORLD_SIZE");
  REQUIRE(size == 2);
  const std::filesystem::path dir = "/tmp/ddp-secret-hosts-" + cluster;
  ddp::stores::file_store store(dir);

  ddp::gloo::options opts;
  opts.interface = env("DDP_HOSTS_IFNAME");  // each host's own address, reachable from the other
  opts.connect_timeout = 20s;
  opts.timeout = 20s;
  const ddp::job_secret jobs = opts.secret;  // ddp-run's
  REQUIRE_FALSE(jobs.empty());

  opts.secret = {};
  opts.key_prefix = "none/";
  try {
    ddp::gloo::communicator c(store, rank, size, opts);
    FAIL("a communicator across hosts without a secret started");
  } catch (const ddp::usage_error& e) {
    INFO(e.what());
    CHECK_THAT(std::string(e.what()), Catch::Contains("spans 2 hosts ('h1', 'h2')") &&
                                          Catch::Contains("no job secret") && Catch::Contains("DDP_JOB_SECRET") &&
                                          Catch::Contains("insecure_no_secret"));
  }

  opts.insecure_no_secret = true;
  opts.key_prefix = "opted-out/";
  {
    ddp::gloo::communicator c(store, rank, size, opts);
    CHECK(reduce_once(c) == 2.0f);
  }

  opts.insecure_no_secret = false;
  opts.secret = jobs;
  opts.key_prefix = "secret/";
  {
    ddp::gloo::communicator c(store, rank, size, opts);
    CHECK(reduce_once(c) == 2.0f);
    // The last collective is a barrier of sorts: both ranks are done with the store.
  }
  if (rank == 0) {
    std::this_thread::sleep_for(200ms);
    std::filesystem::remove_all(dir);
  }
}
