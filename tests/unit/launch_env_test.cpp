// ddp::launch_env (what the launcher says: Slurm, Open MPI, torchrun, ddp-supervise) over a fake
// environment, and ddp::net::local_address_toward on this host (across test hosts:
// tests/hosts/route_hosts_test.cpp).
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include <map>
#include <string>

#include <catch2/catch.hpp>
#include <ddp/launch_env.hpp>
#include <ddp/net/route.hpp>

namespace {

std::optional<ddp::launch_env> detect(const std::map<std::string, std::string>& env) {
  return ddp::launch_env::detect([&](const char* n) -> const char* {
    const auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& env) {
  try {
    (void)detect(env);
  } catch (const ddp::usage_error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("launch_env: Slurm's variables", "[unit][launch]") {
  const auto e = detect({{"SLURM_PROCID", "5"},
                         {"SLURM_NTASKS", "8"},
                         {"SLURM_LOCALID", "1"},
                         {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                         {"SLURM_JOB_ID", "1234"},
                         {"SLURM_STEP_ID", "0"},
                         {"RANK", "9"},  // Slurm comes first
                         {"WORLD_SIZE", "10"}});
  REQUIRE(e);
  CHECK(e->launcher == "slurm");
  CHECK(e->rank == 5);
  CHECK(e->size == 8);
  CHECK(e->local_rank == 1);
  CHECK(e->local_size == 4);
  CHECK(e->job_id == "1234.0");
}

TEST_CASE("launch_env: Open MPI, torchrun, ddp-supervise, none", "[unit][launch]") {
  auto e = detect({{"OMPI_COMM_WORLD_RANK", "2"},
                   {"OMPI_COMM_WORLD_SIZE", "3"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}});
  REQUIRE(e);
  CHECK(e->launcher == "openmpi");
  CHECK((e->rank == 2 && e->size == 3 && e->local_rank == 0 && e->local_size == 1));
  e = detect({{"RANK", "3"},
              {"WORLD_SIZE", "4"},
              {"LOCAL_RANK", "1"},
              {"LOCAL_WORLD_SIZE", "2"},
              {"TORCHELASTIC_RUN_ID", "job7"}});
  REQUIRE(e);
  CHECK(e->launcher == "torchrun");
  CHECK((e->rank == 3 && e->size == 4 && e->local_rank == 1 && e->local_size == 2 && e->job_id == "job7"));
  e = detect({{"DDP_REPLICA_ID", "1"}, {"DDP_REPLICAS", "3"}});
  REQUIRE(e);
  CHECK(e->launcher == "ddp-supervise");
  CHECK((e->rank == 1 && e->size == 3));
  CHECK_FALSE(detect({}));
  CHECK_FALSE(detect({{"SLURM_PROCID", "0"}}));  // no size: not a Slurm task
}

TEST_CASE("launch_env: a value that is wrong is a usage_error naming the variable", "[unit][launch]") {
  CHECK(error_of({{"SLURM_PROCID", "x1"}, {"SLURM_NTASKS", "2"}})
            .find("SLURM_PROCID='x1' is not a non-negative "
                  "integer") != std::string::npos);
  CHECK(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}).find("RANK='-1'") != std::string::npos);
  CHECK(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}).find("torchrun says rank 4 of size 4") != std::string::npos);
  CHECK(error_of({{"RANK", "99999999999"}, {"WORLD_SIZE", "4"}}).find("RANK=") != std::string::npos);
  CHECK(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "7"}, {"SLURM_NTASKS_PER_NODE", "4,3"}})
            .find("nodes run different numbers of tasks") != std::string::npos);
}

namespace {

std::optional<ddp::replica_env> replica(const std::map<std::string, std::string>& env) {
  return ddp::replica_env::detect([&](const char* n) -> const char* {
    const auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string replica_error(const std::map<std::string, std::string>& env) {
  try {
    (void)replica(env);
  } catch (const ddp::usage_error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("replica_env: what ddp-supervise sets, with the store's address", "[unit][launch]") {
  auto e = replica({{"DDP_REPLICA_ID", "2"},
                    {"DDP_REPLICAS", "3"},
                    {"DDP_REPLICA_INCARNATION", "4"},
                    {"DDP_GROUP_RANK", "1"},
                    {"DDP_GROUP_SIZE", "2"},
                    {"DDP_STORE", "redis:10.77.0.1:6380"}});
  REQUIRE(e);
  CHECK((e->id == 2 && e->replicas == 3 && e->incarnation == 4 && e->group_rank == 1 && e->group_size == 2));
  REQUIRE(e->store);
  CHECK((e->store->type == ddp::store_address::kind::redis && e->store->host == "10.77.0.1" && e->store->port == 6380));
  e = replica({{"DDP_REPLICA_ID", "0"}, {"DDP_STORE", "file:/shared/job 7"}});
  REQUIRE(e);
  CHECK((e->replicas == 1 && e->incarnation == 0 && e->group_rank == 0 && e->group_size == 1));
  REQUIRE(e->store);
  CHECK((e->store->type == ddp::store_address::kind::file && e->store->path == "/shared/job 7"));
  e = replica({{"DDP_REPLICA_ID", "0"}, {"DDP_REPLICAS", "2"}});
  REQUIRE(e);
  CHECK_FALSE(e->store);                          // --store none
  CHECK_FALSE(replica({{"DDP_REPLICAS", "3"}}));  // no id: not under ddp-supervise
}

TEST_CASE("replica_env: a wrong value is a usage_error naming the variable", "[unit][launch]") {
  CHECK(replica_error({{"DDP_REPLICA_ID", "3"}, {"DDP_REPLICAS", "3"}}).find("replica id 3 of replica count 3") !=
        std::string::npos);
  CHECK(replica_error({{"DDP_REPLICA_ID", "0"}, {"DDP_GROUP_RANK", "2"}, {"DDP_GROUP_SIZE", "2"}})
            .find("group rank 2 of group size 2") != std::string::npos);
  CHECK(replica_error({{"DDP_REPLICA_ID", "0"}, {"DDP_REPLICA_INCARNATION", "one"}})
            .find("DDP_REPLICA_INCARNATION='one'") != std::string::npos);
  CHECK(replica_error({{"DDP_REPLICA_ID", "0"}, {"DDP_STORE", "nfs:/x"}}).find("DDP_STORE='nfs:/x': unknown kind") !=
        std::string::npos);
  CHECK(replica_error({{"DDP_REPLICA_ID", "0"}, {"DDP_STORE", "file:"}}).find("no directory") != std::string::npos);
  CHECK(replica_error({{"DDP_REPLICA_ID", "0"}, {"DDP_STORE", "redis:6379"}}).find("no host and port") !=
        std::string::npos);
  CHECK(replica_error({{"DDP_REPLICA_ID", "0"}, {"DDP_STORE", "redis:h:0"}}).find("the port must be 1-65535") !=
        std::string::npos);
  CHECK(replica_error({{"DDP_REPLICA_ID", "0"}, {"DDP_STORE", "redis:h:x"}}).find("the port must be") !=
        std::string::npos);
}

TEST_CASE("net::local_address_toward: loopback toward this host, the interface's address toward its own",
          "[unit][launch]") {
  CHECK(ddp::net::local_address_toward("127.0.0.1") == "127.0.0.1");
  CHECK(ddp::net::local_address_toward("localhost") == "127.0.0.1");
  // Every non-loopback IPv4 address of this host routes to itself.
  ifaddrs* all = nullptr;
  REQUIRE(::getifaddrs(&all) == 0);
  for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) != 0 ||
        (i->ifa_flags & IFF_UP) == 0) {
      continue;
    }
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    INFO(i->ifa_name << " " << text);
    CHECK(ddp::net::local_address_toward(text) == text);
  }
  ::freeifaddrs(all);
  try {
    (void)ddp::net::local_address_toward("no-such-host.invalid");
    FAIL("no error");
  } catch (const ddp::usage_error& e) {
    CHECK(std::string(e.what()).find("cannot resolve 'no-such-host.invalid'") != std::string::npos);
  }
}
