#pragma once
// A real redis-server for one test: started on a free loopback port with persistence off,
// stopped (SIGTERM, then SIGKILL) when the object goes away. Extra configuration lines
// (`requirepass`, `user ...`) go to a 0600 file in its directory, not on its command line.

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace gloo_test {

/// Path of redis-server on PATH, or nothing.
inline std::optional<std::string> find_redis_server() {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string d; std::getline(dirs, d, ':');) {
    const auto p = std::filesystem::path(d) / "redis-server";
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return std::nullopt;
}

/// A loopback TCP port nobody listens on right now.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot find a free port");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

inline bool port_accepts(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

class redis_server {
 public:
  /// Starts redis-server on `port` (a free one if 0) with its files in `dir`, and `config`
  /// (redis.conf lines, such as "requirepass secret") on top of the defaults.
  redis_server(const std::string& exe, const std::filesystem::path& dir, int port = 0,
               const std::vector<std::string>& config = {})
      : exe_(exe), dir_(dir), port_(port ? port : free_port()) {
    if (!config.empty()) {
      conf_ = dir_ / "redis.conf";
      {
        std::ofstream out(conf_);
        for (const auto& line : config) out << line << "\n";
        if (!out.flush()) throw std::runtime_error("cannot write " + conf_.string());
      }
      std::filesystem::permissions(conf_, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    }
    start();
  }
  redis_server(const redis_server&) = delete;
  redis_server& operator=(const redis_server&) = delete;
  ~redis_server() { stop(); }

  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] bool running() const { return pid_ > 0; }

  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 200; ++i) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  /// Kills the server abruptly, as a crash would.
  void crash() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  void start() {
    const std::string port = std::to_string(port_);
    const std::string dir = dir_.string();
    const std::string conf = conf_.string();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      const int devnull = ::open("/dev/null", O_WRONLY);
      if (devnull >= 0) ::dup2(devnull, STDOUT_FILENO);
      std::vector<const char*> argv{exe_.c_str()};
      if (!conf.empty()) argv.push_back(conf.c_str());  // the file comes first, the options after it
      for (const char* a : {"--port", port.c_str(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
                            dir.c_str(), "--daemonize", "no", "--loglevel", "warning", "--protected-mode", "yes"}) {
        argv.push_back(a);
      }
      argv.push_back(nullptr);
      ::execv(exe_.c_str(), const_cast<char* const*>(argv.data()));
      std::_Exit(127);
    }
    for (int i = 0; i < 500; ++i) {
      if (port_accepts(port_)) return;
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("redis-server exited at start (port " + port + " taken?)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stop();
    throw std::runtime_error("redis-server did not accept connections within 5 s");
  }

 private:
  std::string exe_;
  std::filesystem::path dir_;
  std::filesystem::path conf_;  // empty: no configuration file
  int port_;
  pid_t pid_ = -1;
};

}  // namespace gloo_test
