#pragma once
// The test hosts a job runs on: `ddp-run --hosts H` sets DDP_HOSTS ("h1 h2 ..."; docs/launching.md).
// Tests that check the node layout expect one node per host, and one node without it.
#include <cstdlib>
#include <sstream>
#include <string>

namespace test_hosts {

/// How many test hosts the job spans: the words of DDP_HOSTS, 1 when it is unset or empty.
inline int count() {
  const char* hosts = std::getenv("DDP_HOSTS");
  int n = 0;
  std::istringstream words(hosts ? hosts : "");
  for (std::string w; words >> w;) ++n;
  return n > 0 ? n : 1;
}

}  // namespace test_hosts
