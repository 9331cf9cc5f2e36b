#pragma once
/// @file gloo.hpp
/// @brief The gloo backend: a CPU communicator over TCP that survives dead peers, built through
/// a rendezvous store. Link `ddp::gloo`. See docs/backends-gloo.md.
///
/// @code
///   ddp::stores::file_store store("/shared/rendezvous");
///   auto ns = ddp::stores::generation_store(store, "job", 0);
///   ddp::gloo::communicator comm(ns, rank, size, {.timeout = std::chrono::seconds(30)});
///   comm.allreduce(views, ddp::reduce_op::avg).wait();
/// @endcode

#include <ddp/gloo/communicator.hpp>
#include <ddp/gloo/enroll.hpp>
#include <ddp/gloo/options.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/stores/prefix_store.hpp>
#include <ddp/stores/sigpipe.hpp>
