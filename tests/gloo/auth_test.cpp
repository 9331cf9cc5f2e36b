// Peers prove the job's secret over every gloo pair before any data moves (docs/security.md):
// the same secret works; another secret, or none, is a clean error naming the pair; a stranger
// (another user, uid 65534) that connects first to a rank's ports gets no data, and no rank
// crashes. Ranks are forked processes.

#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/gloo.hpp>
#include <ddp/job_secret.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/prefix_store.hpp>

#include "../common/other_user.hpp"
#include "process_group.hpp"

using namespace std::chrono_literals;
namespace st = ddp::stores;
using gloo_test::process_group;
using gloo_test::reporter;
using gloo_test::temp_dir;

namespace {

ddp::gloo::options options_with(ddp::job_secret secret, std::chrono::milliseconds connect = 5s) {
  ddp::gloo::options o;
  o.timeout = 3s;
  o.connect_timeout = connect;
  o.secret = std::move(secret);
  return o;
}

/// The value every rank contributes: a pattern a stranger would recognise if it ever got data.
constexpr float pattern = 1234.5f;

/// A store that holds back one key's `set` by `delay`: a member whose address arrives late, so
/// that its peer's listening port is open, waiting, for that long.
struct late_key_store {
  ddp::store_ref inner;
  std::string late_key;
  std::chrono::milliseconds delay;
  void set(std::string_view key, std::span<const std::byte> value) {
    if (key == late_key) std::this_thread::sleep_for(delay);
    inner.set(key, value);
  }
  std::optional<ddp::store_value> get(std::string_view key) { return inner.get(key); }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) { inner.wait(keys, timeout); }
  std::int64_t add(std::string_view key, std::int64_t delta) { return inner.add(key, delta); }
  std::size_t erase_prefix(std::string_view prefix) { return inner.erase_prefix(prefix); }
};

/// Runs `body` and reports "result=ok", or the kind of ddp error it threw ("timeout",
/// "communication", "usage") and its text as "what".
template <class Body>
void report_outcome(const reporter& rep, Body&& body) {
  try {
    body();
    rep.set("result", "ok");
  } catch (const ddp::timeout_error& e) {
    rep.set("result", "timeout");
    rep.set("what", e.what());
  } catch (const ddp::communication_error& e) {
    rep.set("result", "communication");
    rep.set("what", e.what());
  } catch (const ddp::usage_error& e) {
    rep.set("result", "usage");
    rep.set("what", e.what());
  }
}

/// Connects and runs one allreduce; reports "result=ok" or the error's kind and text. A
/// `late_address` holds back this rank's address in the store by that long.
void connect_and_reduce(const std::filesystem::path& dir, int rank, int size, const ddp::gloo::options& opts,
                        const reporter& rep, std::chrono::milliseconds late_address = {}) {
  st::file_store files(dir);
  late_key_store store{ddp::store_ref(files), opts.key_prefix + std::to_string(rank), late_address};
  report_outcome(rep, [&] {
    ddp::gloo::communicator c(store, rank, size, opts);
    std::vector<float> v(4096, pattern);
    ddp::communicator_ref(c).allreduce(v, ddp::reduce_op::sum).wait();
    CHILD_CHECK(v.front() == pattern * static_cast<float>(size), "sum " << v.front());
  });
}

/// This host's first IPv4 address that is not loopback ("" if it has none).
std::string first_non_loopback_ipv4() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return {};
  std::string found;
  for (const ifaddrs* a = all; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || (a->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char text[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text))) {
      found = text;
    }
  }
  ::freeifaddrs(all);
  return found;
}

}  // namespace

TEST_CASE("gloo auth: ranks holding the same secret connect and reduce", "[gloo][auth]") {
  temp_dir dir("gloo-auth-same");
  const auto secret = ddp::job_secret::generate();
  process_group g(
      3, [&](int rank, const reporter& rep) { connect_and_reduce(dir.path(), rank, 3, options_with(secret), rep); });
  const auto outs = g.wait_all(30s);
  INFO(gloo_test::describe_all(outs));
  for (const auto& o : outs) {
    CHECK(o.ok());
    CHECK(o.value("result") == "ok");
  }
}

TEST_CASE("gloo auth: a peer with another secret is refused on both sides, naming the pair", "[gloo][auth]") {
  temp_dir dir("gloo-auth-other");
  const auto t0 = std::chrono::steady_clock::now();
  const auto ours = ddp::job_secret::generate(), theirs = ddp::job_secret::generate();
  process_group g(2, [&](int rank, const reporter& rep) {
    connect_and_reduce(dir.path(), rank, 2, options_with(rank == 0 ? ours : theirs, 20s), rep);
  });
  const auto outs = g.wait_all(30s);
  INFO(gloo_test::describe_all(outs));
  for (const auto& o : outs) {
    REQUIRE(o.ok());
    CHECK(o.value("result") == "communication");
    const std::string peer = o.rank == 0 ? "1" : "0";
    // Rank 0 checks rank 1's proof first and refuses it: it never sends its own.
    CHECK_THAT(o.value("what"), Catch::Contains("gloo connection to rank " + peer));
    if (o.rank == 0) {
      CHECK_THAT(o.value("what"), Catch::Contains("did not prove this communicator's job secret") &&
                                      Catch::Contains("nothing derived from the secret"));
    } else {
      CHECK_THAT(o.value("what"),
                 Catch::Contains("did not authenticate") && Catch::Contains("refused this rank's proof"));
    }
  }
  // Refused at once, not at the 20 s connect deadline.
  CHECK(std::chrono::steady_clock::now() - t0 < 8s);
}

namespace {

/// Connects a bare gloo pair through `dir`'s store and runs ddp's authentication on it, each rank
/// proving and checking with the binding `bind(rank)` gives; reports "ok" or the error.
void authenticate_spliced(const std::filesystem::path& dir, int rank, const ddp::job_secret& secret,
                          const ddp::detail::sha256_digest& binding, const reporter& rep) {
  st::file_store store(dir);
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  ddp::gloo::detail::rendezvous_store rendezvous(store, "mesh/", rank, deadline);
  ::gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = ::gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank, 2);
  ctx->setTimeout(5s);
  ctx->connectFullMesh(rendezvous, device);
  report_outcome(rep, [&] { ddp::gloo::detail::authenticate_pairs(*ctx, secret, binding, deadline); });
}

/// A communicator's binding from fresh member records, as every rank of it computes.
ddp::detail::sha256_digest fresh_binding(const std::string& key_prefix) {
  std::vector<ddp::gloo::detail::peer_record> records(2);
  for (auto& r : records) r.nonce = ddp::detail::fresh_nonce();
  return ddp::gloo::detail::binding_of(records, {{'a'}, {'b'}}, key_prefix);
}

}  // namespace

TEST_CASE("gloo auth: proofs relayed between two communicators of one size and one secret are refused",
          "[gloo][auth][relay]") {
  // What a relay achieves: rank 0 of communicator A and rank 1 of communicator B (both of size 2,
  // one secret, the same key prefix: two replica groups of one job, or two jobs sharing an
  // exported secret) end up on one connection, each believing the other is its own peer. Here the
  // connection is spliced directly (a bare gloo pair); in the field a stranger forwards bytes.
  const auto secret = ddp::job_secret::generate();
  const auto a = fresh_binding("gloo/"), b = fresh_binding("gloo/");
  const auto run = [&](const char* name, const ddp::detail::sha256_digest& of_rank0,
                       const ddp::detail::sha256_digest& of_rank1) {
    temp_dir dir(name);
    process_group g(2, [&](int rank, const reporter& rep) {
      authenticate_spliced(dir.path(), rank, secret, rank == 0 ? of_rank0 : of_rank1, rep);
    });
    return g.wait_all(30s);
  };
  SECTION("relayed: both sides refuse, each naming the connection; the checking side sent nothing derived") {
    const auto outs = run("gloo-auth-relay", a, b);
    INFO(gloo_test::describe_all(outs));
    for (const auto& o : outs) REQUIRE(o.ok());
    CHECK(outs[0].value("result") == "communication");
    CHECK_THAT(outs[0].value("what"), Catch::Contains("gloo connection to rank 1 did not prove this communicator's job "
                                                      "secret") &&
                                          Catch::Contains("nothing derived from the secret") &&
                                          Catch::Contains("relays another communicator's proofs"));
    CHECK(outs[1].value("result") != "ok");
    CHECK_THAT(outs[1].value("what"), Catch::Contains("gloo connection to rank 0 did not authenticate"));
  }
  SECTION("control: one communicator's binding on both sides authenticates") {
    const auto outs = run("gloo-auth-relay-control", a, a);
    INFO(gloo_test::describe_all(outs));
    for (const auto& o : outs) {
      REQUIRE(o.ok());
      CHECK(o.value("result") == "ok");
    }
  }
  SECTION("control: a binding of only the key prefix and size (the proof before #44) lets the relay through") {
    const ddp::detail::proof_nonce none{};
    const std::array<ddp::detail::proof_nonce, 2> same{none, none};
    const auto unbound = ddp::detail::communicator_binding("ddp gloo communicator", "gloo/", 2, same);
    const auto outs = run("gloo-auth-relay-unbound", unbound, unbound);
    for (const auto& o : outs) CHECK(o.value("result") == "ok");
  }
}

TEST_CASE("gloo auth: a peer without a secret is refused on both sides at once", "[gloo][auth]") {
  temp_dir dir("gloo-auth-none");
  const auto t0 = std::chrono::steady_clock::now();
  process_group g(2, [&](int rank, const reporter& rep) {
    auto secret = rank == 0 ? ddp::job_secret::generate() : ddp::job_secret{};
    connect_and_reduce(dir.path(), rank, 2, options_with(std::move(secret), 2s), rep);
  });
  const auto outs = g.wait_all(30s);
  INFO(gloo_test::describe_all(outs));
  // Both refuse at once, from the records, before connecting: neither waits out a deadline.
  for (const auto& o : outs) {
    REQUIRE(o.ok());
    CHECK(o.value("result") == "usage");
    CHECK_THAT(o.value("what"), Catch::Contains("rank(s) 0 hold a job secret and rank(s) 1 do not"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
}

TEST_CASE("gloo auth: the secret from a file is checked like an ssh key", "[gloo][auth]") {
  temp_dir dir("gloo-auth-file");
  const auto path = (dir.path() / "secret").string();
  const std::string hex = ddp::job_secret::random_hex(32);
  { std::ofstream(path) << hex << "\n"; }
  std::filesystem::permissions(path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  const auto s = ddp::job_secret::from_file(path);
  CHECK(s.bytes().size() == hex.size());
  std::filesystem::permissions(path, std::filesystem::perms::group_read, std::filesystem::perm_options::add);
  CHECK_THROWS_WITH(ddp::job_secret::from_file(path), Catch::Contains("mode 640") && Catch::Contains("chmod 600"));
  std::filesystem::create_symlink(path, dir.path() / "link");
  CHECK_THROWS_AS(ddp::job_secret::from_file((dir.path() / "link").string()), ddp::usage_error);
}

TEST_CASE("gloo auth: short, passphrase and low-entropy secrets are refused, saying how to make one", "[gloo][auth]") {
  const auto refused = [](const std::string& text, const char* why) {
    INFO(text);
    CHECK_THROWS_WITH(ddp::job_secret::of(text), Catch::Contains(why) && Catch::Contains("openssl rand -hex 32"));
  };
  refused("short", "at least 32 random bytes");
  refused(ddp::job_secret::random_hex(16), "at least 64 digits");  // 16 bytes as 32 hex digits
  refused(ddp::job_secret::random_hex(24), "at least 64 digits");  // 48 hex digits
  refused("correct horse battery staple", "at least 32 random bytes");
  refused("correct horse battery staple, correct horse battery staple", "not a passphrase");
  refused("correcthorsebatterystaplecorrecthorsebatterystaple", "not a passphrase");
  refused(std::string(64, '0'), "does not look random");
  refused(std::string(32, 'a') + std::string(32, 'b'), "does not look random");
  std::string pattern16;
  for (int i = 0; i < 4; ++i) pattern16 += "0123456789abcdef";  // 4 bits a digit, but a pattern
  refused(pattern16, "repeated pattern");
  // Passphrases of any alphabet and length, base64 too: only hex is text enough.
  refused("CorrectHorseBatteryStapleIsOurTrainingSecret2024", "not a passphrase");
  refused("MyCompanyName-ddp-training-job-secret_2024=prod", "not a passphrase");
  refused("Grüße aus dem Rechenzentrum, unser geheimes Trainingspasswort", "not a passphrase");
  refused("mJ0p4tQmJx0x7wP2cQe1n8dZ3VYhG9aKsT6uLrB5oFI=", "64 or more hex digits");
  // What generate() and `openssl rand -hex 32` make is accepted.
  for (int i = 0; i < 1000; ++i) CHECK_NOTHROW(ddp::job_secret::of(ddp::job_secret::random_hex(32)));
  CHECK_FALSE(ddp::job_secret::generate().empty());
  // Bytes that are not text (a key file) are taken as they are, from 32 up, unless mostly one value.
  std::string raw(32, '\0');
  for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<char>(i * 7 + 1);
  CHECK_NOTHROW(ddp::job_secret::of(raw));
  CHECK_THROWS_WITH(ddp::job_secret::of(raw.substr(1)), Catch::Contains("at least 32 random bytes"));
  CHECK_THROWS_WITH(ddp::job_secret::of(std::string(40, '\x01')), Catch::Contains("bytes do not look random"));
}

TEST_CASE("gloo auth: without a secret, a communicator other hosts can reach refuses to start", "[gloo][auth]") {
  using ddp::gloo::detail::peer_record;
  ddp::gloo::options o;
  o.secret = {};
  CHECK_FALSE(ddp::gloo::detail::reachable_from_other_hosts(o));  // 127.0.0.1, the default
  o.hostname = "localhost";
  CHECK_FALSE(ddp::gloo::detail::reachable_from_other_hosts(o));
  o.hostname = "10.1.2.3";
  CHECK(ddp::gloo::detail::reachable_from_other_hosts(o));
  o.interface = "lo";
  CHECK_FALSE(ddp::gloo::detail::reachable_from_other_hosts(o));
  o.interface = "eth0";
  CHECK(ddp::gloo::detail::reachable_from_other_hosts(o));

  // Records: {nonce, reachable, has_secret, insecure, host}.
  const std::vector<peer_record> one_host{{{}, false, false, false, "n1"}, {{}, false, false, false, "n1"}};
  const std::vector<peer_record> two_hosts{{{}, true, false, false, "n1"}, {{}, true, false, false, "n2"}};
  const std::vector<peer_record> reachable{{{}, false, false, false, "n1"}, {{}, true, false, false, "n1"}};
  const std::vector<peer_record> opted_out{{{}, true, false, true, "n1"}, {{}, true, false, true, "n2"}};
  const std::vector<peer_record> half_opted{{{}, true, false, true, "n1"}, {{}, true, false, false, "n2"}};
  const std::vector<peer_record> secrets{{{}, true, true, false, "n1"}, {{}, true, true, false, "n2"}};
  const std::vector<peer_record> half_secret{{{}, false, true, false, "n1"}, {{}, false, false, false, "n1"}};
  using ddp::gloo::detail::check_secret_rule;
  CHECK_NOTHROW(check_secret_rule(one_host, 1));
  CHECK_THROWS_WITH(check_secret_rule(two_hosts, 1), Catch::Contains("spans 2 hosts ('n1', 'n2')") &&
                                                         Catch::Contains("DDP_JOB_SECRET") &&
                                                         Catch::Contains("insecure_no_secret"));
  CHECK_THROWS_AS(check_secret_rule(two_hosts, 1), ddp::usage_error);
  CHECK_THROWS_WITH(check_secret_rule(reachable, 0),
                    Catch::Contains("listens where other hosts can reach it (rank(s) 1)"));
  CHECK_NOTHROW(check_secret_rule(opted_out, 1));
  // Every rank decides alike: one rank's opt-out is not enough, and none may skip the secret.
  CHECK_THROWS_WITH(check_secret_rule(half_opted, 0), Catch::Contains("not set on rank(s) 1"));
  CHECK_NOTHROW(check_secret_rule(secrets, 1));
  CHECK_THROWS_WITH(check_secret_rule(half_secret, 0),
                    Catch::Contains("rank(s) 0 hold a job secret and rank(s) 1 do not"));

  // Over real processes: listening on this host's non-loopback address without a secret is
  // refused on every rank before anything connects; on loopback it runs.
  const std::string address = first_non_loopback_ipv4();
  if (address.empty()) std::cout << "no non-loopback IPv4 address: only loopback is tried\n";
  temp_dir dir("gloo-auth-closed");
  process_group g(2, [&](int rank, const reporter& rep) {
    st::file_store store(dir.path());
    ddp::gloo::options opts = options_with({}, 5s);
    opts.key_prefix = "lo/";
    ddp::gloo::communicator c(store, rank, 2, opts);
    std::vector<float> v(8, 1.0f);
    ddp::communicator_ref(c).allreduce(v, ddp::reduce_op::sum).wait();
    rep.set("loopback", v[0] == 2.0f ? "ok" : "wrong");
    if (address.empty()) return;
    opts.key_prefix = "any/";
    opts.hostname = address;
    try {
      ddp::gloo::communicator open(store, rank, 2, opts);
      rep.set("any", "started");
    } catch (const ddp::usage_error& e) {
      rep.set("any", e.what());
    }
  });
  const auto outs = g.wait_all(30s);
  INFO(gloo_test::describe_all(outs));
  for (const auto& o : outs) {
    REQUIRE(o.ok());
    CHECK(o.value("loopback") == "ok");
    if (address.empty()) continue;
    CHECK_THAT(o.value("any"),
               Catch::Contains("listens where other hosts can reach it") && Catch::Contains("no job secret"));
  }
}

namespace {

/// Loopback ports on which any of `pids` listens (from /proc: their socket inodes, and
/// /proc/net/tcp's listening entries).
std::set<int> listening_ports(const std::vector<pid_t>& pids) {
  std::set<std::string> inodes;
  for (pid_t pid : pids) {
    const std::string fds = "/proc/" + std::to_string(pid) + "/fd";
    DIR* d = ::opendir(fds.c_str());
    if (d == nullptr) continue;
    while (const dirent* e = ::readdir(d)) {
      char target[128] = {};
      const std::string link = fds + "/" + e->d_name;
      const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
      if (n > 9 && std::strncmp(target, "socket:[", 8) == 0) {
        inodes.insert(std::string(target + 8, static_cast<std::size_t>(n) - 9));
      }
    }
    ::closedir(d);
  }
  std::set<int> ports;
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);
  while (std::getline(tcp, line)) {
    std::istringstream in(line);
    std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
    in >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
    if (state != "0A" || inodes.count(inode) == 0) continue;
    ports.insert(std::stoi(local.substr(local.find(':') + 1), nullptr, 16));
  }
  return ports;
}

enum class stranger_mode { silent, garbage, zeros };

/// As uid 65534: connects to each port read from `ports_fd` (one per line) until the pipe closes,
/// sends what `mode` says, keeps every connection open, and reads all it is sent. Exit code:
/// 0 and "connections=N" on stdout if no float of the ranks' pattern arrived; 3 if one did.
int stranger(int ports_fd, stranger_mode mode) {
  std::vector<int> socks;
  std::string pending;
  bool open = true;
  bool saw_pattern = false;
  std::string received;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline && (open || !socks.empty())) {
    std::vector<pollfd> fds;
    if (open) fds.push_back({ports_fd, POLLIN, 0});
    for (int s : socks) fds.push_back({s, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 50) < 0) break;
    for (const auto& p : fds) {
      if ((p.revents & (POLLIN | POLLHUP)) == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(p.fd, buf, sizeof(buf));
      if (p.fd == ports_fd) {
        if (n <= 0) {
          open = false;
          continue;
        }
        pending.append(buf, static_cast<std::size_t>(n));
        for (auto nl = pending.find('\n'); nl != std::string::npos; nl = pending.find('\n')) {
          const int port = std::stoi(pending.substr(0, nl));
          pending.erase(0, nl + 1);
          const int s = ::socket(AF_INET, SOCK_STREAM, 0);
          sockaddr_in a{};
          a.sin_family = AF_INET;
          a.sin_port = htons(static_cast<std::uint16_t>(port));
          a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
            ::close(s);
            continue;
          }
          std::vector<unsigned char> junk(56, 0);
          if (mode == stranger_mode::garbage) {
            for (std::size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<unsigned char>(i * 37 + 11);
          }
          if (mode != stranger_mode::silent) (void)!::write(s, junk.data(), junk.size());
          socks.push_back(s);
        }
      } else if (n <= 0) {
        ::close(p.fd);
        std::erase(socks, p.fd);
      } else {
        received.append(buf, static_cast<std::size_t>(n));
      }
    }
  }
  for (std::size_t i = 0; i + sizeof(float) <= received.size(); ++i) {
    float f = 0;
    std::memcpy(&f, received.data() + i, sizeof(f));
    if (f == pattern) saw_pattern = true;
  }
  std::printf("stranger: %zu bytes received\n", received.size());
  for (int s : socks) ::close(s);
  return saw_pattern ? 3 : 0;
}

}  // namespace

TEST_CASE("gloo auth: a stranger connecting first to the ranks' ports gets no data; nobody crashes",
          "[gloo][auth][stranger]") {
  if (!other_user::can_switch_user()) {
    std::cout << "SKIP: not root, cannot run a stranger as another user\n";
    return;
  }
  const auto mode = GENERATE(stranger_mode::silent, stranger_mode::garbage, stranger_mode::zeros);
  temp_dir dir("gloo-auth-stranger");
  const auto secret = ddp::job_secret::generate();
  int ports_pipe[2];
  REQUIRE(::pipe(ports_pipe) == 0);
  // Rank 1's address arrives 1 s late, so rank 0's ports are open, waiting, and the stranger is
  // there first.
  process_group g(2, [&](int rank, const reporter& rep) {
    ::close(ports_pipe[0]);
    ::close(ports_pipe[1]);
    connect_and_reduce(dir.path(), rank, 2, options_with(secret, 3s), rep, rank == 1 ? 1000ms : 0ms);
  });
  const pid_t stranger_pid = other_user::start([&] {
    ::close(ports_pipe[1]);
    return stranger(ports_pipe[0], mode);
  });
  ::close(ports_pipe[0]);
  const auto ignore_sigpipe = std::signal(SIGPIPE, SIG_IGN);  // writes to a stranger that left
  // Hand the stranger every port the ranks listen on, as soon as it appears.
  std::set<int> told;
  const auto until = std::chrono::steady_clock::now() + 2s;
  while (std::chrono::steady_clock::now() < until) {
    for (int port : listening_ports({g.pid(0), g.pid(1)})) {
      if (!told.insert(port).second) continue;
      const std::string line = std::to_string(port) + "\n";
      (void)!::write(ports_pipe[1], line.data(), line.size());
    }
    std::this_thread::sleep_for(2ms);
  }
  ::close(ports_pipe[1]);
  std::signal(SIGPIPE, ignore_sigpipe);
  const auto outs = g.wait_all(30s);
  const int stranger_code = other_user::wait(stranger_pid);
  INFO("mode " << static_cast<int>(mode) << ", ports handed to the stranger: " << told.size() << "\n"
               << gloo_test::describe_all(outs));
  CHECK(stranger_code == 0);  // 3: it received the ranks' data; 127: it crashed
  CHECK_FALSE(told.empty());
  for (const auto& o : outs) {
    REQUIRE(o.exited);  // never a crash (a signal)
    CHECK(o.code == 0);
    const auto result = o.value("result");
    // The job proceeds (the stranger's connection was never accepted) or fails with an error.
    if (result != "ok") CHECK_FALSE(o.value("what").empty());
  }
}

namespace {

/// The ports `pid` listens on at 127.0.0.1.
std::set<int> loopback1_ports(pid_t pid) {
  std::set<int> out;
  for (int port : listening_ports({pid})) out.insert(port);
  std::set<int> on_1;
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);
  while (std::getline(tcp, line)) {
    std::istringstream in(line);
    std::string sl, local;
    in >> sl >> local;
    const int port = std::stoi(local.substr(local.find(':') + 1), nullptr, 16);
    if (local.rfind("0100007F:", 0) == 0 && out.count(port) != 0) on_1.insert(port);
  }
  return on_1;
}

/// As uid 65534: reads two ports ("A B\n") from `ports_fd`, connects to both at 127.0.0.1 and
/// forwards every byte each way until either side closes. Exit code: 0 if bytes went both ways
/// and no float of the ranks' pattern crossed; 3 if one did; 4 if the relay never carried bytes
/// both ways; 5 if it could not connect.
int relay(int ports_fd) {
  std::string text;
  char c = 0;
  while (::read(ports_fd, &c, 1) == 1 && c != '\n') text += c;
  std::istringstream in(text);
  int port_a = 0, port_b = 0;
  if (!(in >> port_a >> port_b)) return 5;
  const auto dial = [](int port) {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(s);
      return -1;
    }
    return s;
  };
  const int a = dial(port_a), b = dial(port_b);
  if (a < 0 || b < 0) return 5;
  std::string seen;
  std::size_t a_to_b = 0, b_to_a = 0;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  bool open = true;
  while (open && std::chrono::steady_clock::now() < deadline) {
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    if (::poll(fds, 2, 50) < 0) break;
    for (int i = 0; i < 2 && open; ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
      if (n <= 0) {
        open = false;
        break;
      }
      const int to = i == 0 ? b : a;
      (void)!::write(to, buf, static_cast<std::size_t>(n));
      (i == 0 ? a_to_b : b_to_a) += static_cast<std::size_t>(n);
      seen.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::close(a);
  ::close(b);
  std::printf("relay: %zu bytes a->b, %zu bytes b->a\n", a_to_b, b_to_a);
  for (std::size_t i = 0; i + sizeof(float) <= seen.size(); ++i) {
    float f = 0;
    std::memcpy(&f, seen.data() + i, sizeof(f));
    if (f == pattern) return 3;
  }
  return a_to_b > 0 && b_to_a > 0 ? 0 : 4;
}

}  // namespace

TEST_CASE("gloo auth: a stranger relaying between two communicators of one size and one secret gets nothing across",
          "[gloo][auth][stranger]") {
  if (!other_user::can_switch_user()) {
    std::cout << "SKIP: not root, cannot run a stranger as another user\n";
    return;
  }
  // Communicators A (processes 0, 1) and B (processes 2, 3), both of size 2 under one secret and
  // key prefix "gloo/": two jobs sharing an exported secret (two store directories), or two
  // replica groups of one job (one directory, two namespaces). Rank 0 of A and rank 1 of B listen
  // on 127.0.0.1, their peers on 127.0.0.2, so A0's and B1's pairs are the listening sides (gloo
  // listens on the smaller address); the peers publish their addresses 1.5 s late. The stranger,
  // uid 65534, connects to A0's and B1's ports first and forwards bytes between them: A0 and B1
  // then share a connection, each taking the other for its own peer, ranks 0 and 1 as they
  // expect. Before #44 they accepted each other's proofs and reduced together through it.
  const bool one_job = GENERATE(false, true);
  const auto secret = ddp::job_secret::generate();
  temp_dir dir_a(one_job ? "gloo-relay-job" : "gloo-relay-a"), dir_b("gloo-relay-b");
  int ports_pipe[2];
  REQUIRE(::pipe(ports_pipe) == 0);
  process_group g(4, [&](int process, const reporter& rep) {
    ::close(ports_pipe[0]);
    ::close(ports_pipe[1]);
    const bool in_a = process < 2;
    const int rank = process % 2;
    const bool first = in_a ? rank == 0 : rank == 1;  // the listening side
    st::file_store files((in_a || one_job ? dir_a : dir_b).path());
    st::prefix_store<st::file_store> ns(files, one_job ? (in_a ? "group-a/" : "group-b/") : "");
    late_key_store store{ddp::store_ref(ns), first ? "" : "gloo/" + std::to_string(rank), 1500ms};
    auto opts = options_with(secret, 8s);
    opts.hostname = first ? "127.0.0.1" : "127.0.0.2";
    report_outcome(rep, [&] {
      ddp::gloo::communicator c(store, rank, 2, opts);
      std::vector<float> v(4096, pattern);
      ddp::communicator_ref(c).allreduce(v, ddp::reduce_op::sum).wait();
    });
  });
  const pid_t stranger_pid = other_user::start([&] {
    ::close(ports_pipe[1]);
    return relay(ports_pipe[0]);
  });
  ::close(ports_pipe[0]);
  // A0's and B1's ports, as soon as both listen.
  std::set<int> a0, b1;
  const auto until = std::chrono::steady_clock::now() + 3s;
  while ((a0.empty() || b1.empty()) && std::chrono::steady_clock::now() < until) {
    a0 = loopback1_ports(g.pid(0));
    b1 = loopback1_ports(g.pid(3));
    std::this_thread::sleep_for(2ms);
  }
  const auto ignore_sigpipe = std::signal(SIGPIPE, SIG_IGN);
  if (!a0.empty() && !b1.empty()) {
    const std::string line = std::to_string(*a0.begin()) + " " + std::to_string(*b1.begin()) + "\n";
    (void)!::write(ports_pipe[1], line.data(), line.size());
  }
  ::close(ports_pipe[1]);
  std::signal(SIGPIPE, ignore_sigpipe);
  const auto outs = g.wait_all(40s);
  const int stranger_code = other_user::wait(stranger_pid);
  INFO((one_job ? "one job" : "two jobs") << "; A0 ports " << a0.size() << ", B1 ports " << b1.size() << "\n"
                                          << gloo_test::describe_all(outs));
  REQUIRE(a0.size() == 1);
  REQUIRE(b1.size() == 1);
  CHECK(stranger_code == 0);  // 3: the ranks' data crossed; 4: the relay carried nothing; 127: crashed
  for (const auto& o : outs) {
    REQUIRE(o.exited);  // never a crash
    CHECK(o.code == 0);
    CHECK(o.value("result") != "ok");
    CHECK_FALSE(o.value("what").empty());
  }
  // A0 checks B1's proof first (B1 is rank 1: it proves first) and refuses it, sending nothing
  // derived from the secret; B1 then finds the connection closed.
  CHECK_THAT(outs[0].value("what"), Catch::Contains("did not prove this communicator's job secret") &&
                                        Catch::Contains("nothing derived from the secret"));
  CHECK_THAT(outs[3].value("what"), Catch::Contains("gloo connection to rank 0 did not authenticate"));
}

TEST_CASE("gloo auth: TLS where gloo has it, a clear error where it does not", "[gloo][auth]") {
  temp_dir dir("gloo-tls");
  st::file_store store(dir.path());
  ddp::gloo::options opts;
  opts.tls = ddp::gloo::tls_files{.private_key = "key.pem", .certificate = "cert.pem", .ca_file = "ca.pem"};
#if GLOO_HAVE_TRANSPORT_TCP_TLS
  // Files that do not exist: gloo's TLS device refuses them when it loads them.
  CHECK_THROWS_AS(ddp::gloo::communicator(store, 0, 1, opts), ddp::error);
#else
  CHECK_THROWS_WITH(ddp::gloo::communicator(store, 0, 1, opts),
                    Catch::Contains("built without its TLS transport") && Catch::Contains("job secret"));
#endif
}
