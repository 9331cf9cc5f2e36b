#!/usr/bin/env python3
"""PyTorch side of ddp's side-by-side benchmark (docs/benchmarks.md explains every method).

Runs WORLD ranks (default 2) as processes started with multiprocessing's "spawn" (no torchrun),
each with a gloo process group on CPU, and writes one JSON file with the per-iteration samples of
the slowest rank. Cases:

  sync     gradient synchronisation of a model built from a shapes file (one nn.Parameter per
           line, registration order). Per iteration, each preceded by an untimed barrier:
             plain   forward + backward of the bare module (grads set to None first)
             ddp     the same through DistributedDataParallel (gloo, default bucket_cap_mb)
             flat    one dist.all_reduce of a flat float32 tensor of all gradient elements
           The forward is  out = x + sum_i p_i.sum() * 0,  so the backward only fills every
           gradient with zeros, in reverse registration order, and every DDP hook fires.
           Synchronisation cost = median(ddp) - median(plain).
  join     per-iteration cost of the Join context: blocks of N DDP steps of a small model,
           alternately bare and inside `with Join([ddp]):`; the context's exit is timed apart.
  buffers  buffer synchronisation: the same module twice, one DDP with broadcast_buffers=True
           and one with False; the module has every normalisation layer of the shapes file as
           a running mean and a running variance buffer (a 1-D "*.weight" parameter marks one).
           Buffers are broadcast at the start of each forward: cost = median(forward, True)
           - median(forward, False).

Only the interpreter that has torch can run this; bench/compare_pytorch.sh finds it. torch 1.13
can hang at exit in the DDP reducer's destructor, so each rank ends with a barrier and os._exit.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

SMALL_MODEL = [("small.weight", (256, 256)), ("small.bias", (256,))]


def read_shapes(path):
    shapes = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, dims = line.split()
            shapes.append((name, tuple(int(d) for d in dims.split("x"))))
    return shapes


def norm_layers(shapes):
    """Names and lengths of the normalisation layers: 1-D parameters named *.weight."""
    return [(name[: -len(".weight")], dims[0]) for name, dims in shapes if name.endswith(".weight") and len(dims) == 1]


def numel(dims):
    n = 1
    for d in dims:
        n *= d
    return n


# ---- the cases (run inside each rank) ---------------------------------------------------------


def make_module(torch, shapes, buffers=()):
    class ShapesModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(dims)) for _, dims in shapes])
            for i, (_, n) in enumerate(buffers):
                self.register_buffer("running_mean_%d" % i, torch.zeros(n))
                self.register_buffer("running_var_%d" % i, torch.ones(n))

        def forward(self, x):
            out = x
            for p in self.params:
                out = out + p.sum() * 0.0
            return out

    return ShapesModule()


def slowest_rank(torch, dist, samples):
    """Per-iteration maximum over ranks (one allreduce, after the timed loop)."""
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def case_sync(torch, dist, args):
    from torch.nn.parallel import DistributedDataParallel as DDP

    shapes = read_shapes(args.shapes)
    module = make_module(torch, shapes)
    ddp = DDP(module)  # gloo on CPU: device_ids None; bucket_cap_mb default (25)
    params = list(module.parameters())
    x = torch.zeros(())
    total = sum(numel(d) for _, d in shapes)
    flat = torch.zeros(total)

    for p in params:
        p.grad = torch.zeros_like(p)

    def step(model):
        for p in params:  # untimed: gradients stay allocated, as in a training loop with zero_grad()
            if args.grads == "none":
                p.grad = None
            else:
                p.grad.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        model(x).backward()
        return (time.perf_counter() - t0) * 1e3

    def flat_step():
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        return (time.perf_counter() - t0) * 1e3

    for _ in range(args.warmup):  # DDP rebuilds its buckets after the first iteration
        step(module)
        step(ddp)
        flat_step()
    plain, synced, flat_ms = [], [], []
    for _ in range(args.iters):
        plain.append(step(module))
        synced.append(step(ddp))
        flat_ms.append(flat_step())
    info = {"parameters": len(params), "elements": total, "bytes": 4 * total}
    try:
        data = ddp._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        if sizes:
            info["buckets"] = len(str(sizes).split(","))
    except Exception:  # private API: information only
        pass
    return {
        "samples": {
            "pytorch_plain_backward": slowest_rank(torch, dist, plain),
            "pytorch_ddp_backward": slowest_rank(torch, dist, synced),
            "pytorch_flat_allreduce": slowest_rank(torch, dist, flat_ms),
        },
        "info": info,
    }


def case_join(torch, dist, args):
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = make_module(torch, SMALL_MODEL)
    ddp = DDP(module)
    params = list(module.parameters())
    x = torch.zeros(())

    def one():
        for p in params:
            p.grad = None
        ddp(x).backward()

    def block(use_join):
        dist.barrier()
        exit_ms = 0.0
        if use_join:
            ctx = Join([ddp])
            ctx.__enter__()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            one()
        per_iter = (time.perf_counter() - t0) * 1e3 / args.iters
        if use_join:
            t1 = time.perf_counter()
            ctx.__exit__(None, None, None)
            exit_ms = (time.perf_counter() - t1) * 1e3
        return per_iter, exit_ms

    for _ in range(args.warmup):
        one()
    bare, joined, exits = [], [], []
    for _ in range(args.rounds):
        bare.append(block(False)[0])
        j, e = block(True)
        joined.append(j)
        exits.append(e)
    return {
        "samples": {
            "pytorch_step_bare": slowest_rank(torch, dist, bare),
            "pytorch_step_join": slowest_rank(torch, dist, joined),
            "pytorch_join_exit": slowest_rank(torch, dist, exits),
        },
        "info": {"elements": sum(numel(d) for _, d in SMALL_MODEL), "iterations_per_block": args.iters},
    }


def case_buffers(torch, dist, args):
    from torch.nn.parallel import DistributedDataParallel as DDP

    layers = norm_layers(read_shapes(args.shapes))
    tiny = [("w", (1,))]
    models = {}
    for flag in (True, False):
        m = make_module(torch, tiny, layers)
        models[flag] = (m, DDP(m, broadcast_buffers=flag))
    x = torch.zeros(())

    def step(flag):
        m, ddp = models[flag]
        for p in m.parameters():
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        out = ddp(x)  # with broadcast_buffers=True the buffers are broadcast here
        t1 = time.perf_counter()
        out.backward()
        return (t1 - t0) * 1e3

    for _ in range(args.warmup):
        step(True)
        step(False)
    on, off = [], []
    for _ in range(args.iters):
        on.append(step(True))
        off.append(step(False))
    elements = 2 * sum(n for _, n in layers)
    return {
        "samples": {
            "pytorch_forward_broadcast_buffers": slowest_rank(torch, dist, on),
            "pytorch_forward_no_buffers": slowest_rank(torch, dist, off),
        },
        "info": {"buffers": 2 * len(layers), "elements": elements, "bytes": 4 * elements},
    }


CASES = {"sync": case_sync, "join": case_join, "buffers": case_buffers}


def enter_test_host(host):
    """Moves this process into test host h<host> of `ddp-run --hosts` (docs/launching.md): its
    network namespace, where gloo's interface is eth0. The rendezvous file is on the shared disk."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    path = "/run/netns/%s-h%d" % (os.environ["DDP_HOSTS_ID"], host)
    fd = os.open(path, os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "setns " + path)
    os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("DDP_HOSTS_IFNAME", "eth0")


def rank_main(rank, world, init_file, args, out_path):
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # one compute thread per rank, like the C++ side; 2 ranks on 2 cores
        if args.hosts:
            enter_test_host(rank * args.hosts // world + 1)
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
        result = CASES[args.case](torch, dist, args)
        if rank == 0:
            result.update(
                {
                    "case": args.case,
                    "world": world,
                    "torch": torch.__version__,
                    "python": sys.executable,
                    "threads_per_rank": torch.get_num_threads(),
                }
            )
            with open(out_path, "w") as f:
                json.dump(result, f)
        dist.barrier()  # nobody leaves while a peer still talks to it
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: torch 1.13's reducer destructor can hang there


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--shapes", help="shapes file (sync, buffers)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (join: iterations per block)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10, help="join: blocks of each kind")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--grads", choices=("zero", "none"), default="zero",
                   help="sync: before each step, zero the gradients in place (default) or set them to None")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--hosts", type=int, default=0,
                   help="place the ranks on this many test hosts, by block (run under ddp-run --hosts --hosts-only)")
    p.add_argument("--out", required=True, help="JSON result file (per-iteration samples)")
    p.add_argument("--csv", help="also write the printed table as CSV")
    args = p.parse_args(argv)
    if args.case in ("sync", "buffers") and not args.shapes:
        p.error("--shapes is required for " + args.case)

    import multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ddp_pt_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=rank_main, args=(r, args.world, init_file, args, args.out)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        if hung:
            print("ddp_worker: ranks %s did not finish within %.0f s" % (hung, args.timeout), file=sys.stderr)
            return 1
        failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
        if failed:
            print("ddp_worker: ranks %s failed" % failed, file=sys.stderr)
            return 1
    report(args)
    return 0


def report(args):
    """Prints the medians of the result file as a table; with --csv, writes the same as CSV."""
    import csv
    import statistics

    with open(args.out) as f:
        data = json.load(f)
    rows = [("measured", "median_ms", "min_ms", "max_ms", "n")]
    for name, v in sorted(data["samples"].items()):
        rows.append((name, "%.3f" % statistics.median(v), "%.3f" % min(v), "%.3f" % max(v), str(len(v))))
    info = ", ".join("%s=%s" % kv for kv in sorted(data.get("info", {}).items()))
    print("PyTorch %s, case %s, %d ranks (gloo); slowest rank per iteration; %s"
          % (data.get("torch", "?"), args.case, args.world, info))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.writer(f).writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
