// Misuses of JoinContext that must not compile, each with a message that names ddp::joinable.
// CMake compiles this file once per case (-DDDP_CASE_<name>) and checks the diagnostic text; the
// control case (no macro) must compile cleanly.

#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/join.hpp>
#include <ddp/local/communicator.hpp>

namespace {

struct neutral_hook {
  void main_hook(const ddp::join_round&) {}
  void post_hook(const ddp::join_summary&) {}
};

// A joinable that issues no collective: the smallest type that models ddp::joinable.
struct quiet_joinable {
  ddp::communicator_ref comm;
  neutral_hook join_hook(const ddp::join_hook_options&) { return {}; }
  ddp::communicator_ref join_communicator() { return comm; }
};

// join_hook() but no join_communicator().
struct without_communicator {
  neutral_hook join_hook(const ddp::join_hook_options&) { return {}; }
};

// A join_hook() whose result has main_hook() but no post_hook().
struct half_hook {
  void main_hook(const ddp::join_round&) {}
};
struct with_half_hook {
  ddp::communicator_ref comm;
  half_hook join_hook(const ddp::join_hook_options&) { return {}; }
  ddp::communicator_ref join_communicator() { return comm; }
};

}  // namespace

void misuse(ddp::local::communicator& comm) {
  std::vector<float> g(4);
  ddp::Bucketer grads(comm);
  grads.add(g);
  quiet_joinable quiet{comm};
#if defined(DDP_CASE_not_a_joinable)
  int steps = 0;
  ddp::JoinContext join({}, grads, steps);  // an int among the joinables
#elif defined(DDP_CASE_explicit_not_a_joinable)
  int steps = 0;
  ddp::JoinContext<int> join({}, steps);
#elif defined(DDP_CASE_without_communicator)
  without_communicator w;
  ddp::JoinContext join({}, w);
#elif defined(DDP_CASE_hook_without_post_hook)
  with_half_hook h{comm};
  ddp::JoinContext join({}, quiet, h);
#else
  ddp::JoinContext join({}, grads, quiet);  // the control case compiles
  join.abandon();
#endif
}
