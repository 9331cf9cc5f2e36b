// Misuses of BufferReducer that must not compile, each with a message that says what is wrong.
// CMake compiles this file once per case (-DDDP_CASE_<name>) and checks the diagnostic text.

#include <cstdint>
#include <vector>

#include <ddp/buffer_reducer.hpp>
#include <ddp/local/communicator.hpp>
#include <ddp/strategies/allreduce.hpp>

void misuse(ddp::local::communicator& comm) {
  std::vector<float> buf(4);
  ddp::BufferReducer buffers(comm);
#if defined(DDP_CASE_not_a_strategy)
  buffers.add(buf, 42);  // neither a buffer_strategy nor a callable
#elif defined(DDP_CASE_callable_returns_void)
  buffers.add(buf, [](std::span<const ddp::tensor_view>, ddp::communicator_ref) {});
#elif defined(DDP_CASE_temporary_container)
  buffers.add(std::vector<float>(4));  // would dangle
#elif defined(DDP_CASE_const_buffer)
  const std::vector<float>& ro = buf;
  buffers.add(ro);
#elif defined(DDP_CASE_not_a_tensor)
  std::vector<bool> bits(4);
  buffers.add(bits);
#elif defined(DDP_CASE_default_not_a_strategy)
  ddp::BufferReducer<int> bad(comm);
#else
  buffers.add(buf, ddp::strategies::allreduce_sum{});  // the control case compiles
#endif
}
