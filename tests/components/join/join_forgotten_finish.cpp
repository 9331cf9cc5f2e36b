// A trainer that calls notify() and never finish(): the process must terminate with a message
// (registered with WILL_FAIL and a regex on the output).
#include <ddp/bucketer.hpp>
#include <ddp/join.hpp>
#include <ddp/local/communicator.hpp>

int main() {
  ddp::local::run(1, [](ddp::local::communicator& c) {
    std::vector<float> g(2);
    ddp::Bucketer b(c);
    b.add(g);
    ddp::JoinContext join({}, b);
    join.notify();
  });
  return 0;
}
