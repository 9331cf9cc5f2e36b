#!/usr/bin/env python3
"""Side-by-side benchmark, ddp vs PyTorch DDP, in one run (started by bench/compare_pytorch.sh).

For each round, for each model, the PyTorch worker (bench/pytorch/ddp_worker.py, under the
interpreter that has torch) and the ddp program (bench/ddp_vs_pytorch, under mpiexec) run one
after the other, never at the same time; the order alternates between rounds, so slow phases of a
shared machine hit both stacks alike. Every sample is the slowest rank's time of one iteration.
At the end it prints the tables (medians over all rounds, ratios ddp / PyTorch) and, with
--csv, writes the same numbers as CSV. Needs no torch itself (it only starts the worker).

Derived figures (docs/benchmarks.md): differences are taken iteration by iteration (the two
measurements run back to back), then summarised by their median and their minimum ("best": the
least-disturbed iteration, which matters on a shared machine).
  PyTorch DDP sync   DDP backward - plain backward
  ddp matched        Bucketer-synced zero-fill backward - plain zero-fill backward
  join overhead      per-iteration time with join - without (per block)
  buffer sync        PyTorch: forward with broadcast_buffers - without;
                     ddp: the time of BufferReducer::sync()
"""

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DDP_RUN = os.path.join(HERE, "..", "..", "scripts", "ddp-run")
ROOT = os.path.dirname(os.path.dirname(HERE))


def median(v):
    return statistics.median(v) if v else float("nan")


def paired(a, b):
    """Median of element-wise differences a[i] - b[i]."""
    return median([x - y for x, y in zip(a, b)])


def best(v):
    return min(v) if v else float("nan")


def paired_best(a, b):
    """Smallest element-wise difference a[i] - b[i]: the least-disturbed iteration."""
    return best([x - y for x, y in zip(a, b)])


def fmt(v, digits=2):
    return "n/a" if v != v else ("%.*f" % (digits, v))


def ratio(a, b):
    return a / b if b and b == b and a == a and b > 0 else float("nan")


class Runner:
    def __init__(self, args):
        self.args = args
        self.samples = {}  # (case, model, name) -> list of ms
        self.info = {}  # (case, model) -> dict
        self.log = []

    def record(self, case, model, path):
        with open(path) as f:
            data = json.load(f)
        for name, values in data["samples"].items():
            self.samples.setdefault((case, model, name), []).extend(values)
        info = dict(data.get("info", {}))
        if "torch" in data and "buckets" in info:  # the PyTorch worker's bucket count, kept apart
            info["pytorch_buckets"] = info.pop("buckets")
        self.info.setdefault((case, model), {}).update(info)
        for k in ("torch", "python"):
            if k in data:
                self.info.setdefault(("meta", ""), {})[k] = data[k]

    def run(self, cmd, what):
        t0 = time.monotonic()
        print("  %-38s" % what, end="", flush=True)
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(" %6.1f s" % (time.monotonic() - t0), flush=True)
        if p.returncode != 0:
            sys.stdout.write(p.stdout)
            raise SystemExit("failed (exit %d): %s" % (p.returncode, " ".join(cmd)))
        self.log.append(p.stdout)

    def pytorch(self, case, model, shapes, extra):
        out = os.path.join(self.args.out_dir, "pt_%s_%s.json" % (case, model))
        cmd = [self.args.torch_python, os.path.join(HERE, "ddp_worker.py"), case, "--out", out, "--world", str(self.args.np)]
        if self.args.hosts:  # the worker places its ranks on the hosts itself
            cmd = self.hosts_flags() + ["--hosts-only"] + cmd + ["--hosts", str(self.args.hosts)]
        if shapes:
            cmd += ["--shapes", shapes]
        self.run(cmd + extra, "PyTorch %s %s" % (case, model))
        self.record(case, model, out)

    def ddp(self, case, model, shapes, extra):
        out = os.path.join(self.args.out_dir, "ddp_%s_%s.json" % (case, model))
        # Through ddp-run: it returns once the ranks are done even if mpiexec hangs in its teardown.
        cmd = [DDP_RUN, "--mpiexec", self.args.mpiexec, "--mpi-flags", " ".join(self.args.mpiexec_args),
               "-n", str(self.args.np), self.args.ddp_bench, case, "--json", out]
        if self.args.hosts:
            cmd = self.hosts_flags() + ["--ranks-per-host", str(self.args.np // self.args.hosts)] + cmd[1:]
        if shapes:
            cmd += ["--shapes", shapes, "--model", model]
        self.run(cmd + extra, "ddp     %s %s" % (case, model))
        self.record(case, model, out)

    def hosts_flags(self):
        """ddp-run across test hosts (docs/launching.md): both stacks' ranks on the same hosts."""
        flags = [DDP_RUN, "--hosts", str(self.args.hosts)]
        if self.args.link_rate:
            flags += ["--link-rate", self.args.link_rate]
        return flags

    def both(self, round_index, case, model, shapes, pt_extra, ddp_extra):
        steps = [lambda: self.pytorch(case, model, shapes, pt_extra), lambda: self.ddp(case, model, shapes, ddp_extra)]
        if round_index % 2:
            steps.reverse()
        for s in steps:
            s()

    def get(self, case, model, name):
        return self.samples.get((case, model, name), [])


NAN = float("nan")


class Stat:
    """A measured figure: median and best (minimum) over iterations, and the sample count."""

    def __init__(self, samples=None, minus=None):
        samples = samples or []
        if minus is not None:  # paired difference, iteration by iteration
            samples = [x - y for x, y in zip(samples, minus)]
        self.median, self.best, self.n = median(samples), best(samples), len(samples)


def build_tables(r, models, cases):
    """Rows: dict(table, model, stack, measured, stat, ref, note); ref = the PyTorch Stat compared with."""
    rows = []

    def row(table, model, stack, measured, stat, note="", ref=None):
        rows.append(dict(table=table, model=model, stack=stack, measured=measured, stat=stat, ref=ref, note=note))

    if "sync" in cases:
        for m in models:
            g = lambda n: r.get("sync", m, n)
            info = r.info.get(("sync", m), {})
            pt_sync = Stat(g("pytorch_ddp_backward"), g("pytorch_plain_backward"))
            pt_flat = Stat(g("pytorch_flat_allreduce"))
            pt_info = r.info.get(("sync", m), {})
            row("sync", m, "pytorch", "DDP sync (DDP - plain backward)", pt_sync,
                "gloo, bucket_cap_mb=25, %s buckets" % pt_info.get("pytorch_buckets", "?"))
            row("sync", m, "pytorch", "DDP backward", Stat(g("pytorch_ddp_backward")))
            row("sync", m, "pytorch", "plain backward", Stat(g("pytorch_plain_backward")))
            row("sync", m, "pytorch", "flat allreduce (gloo)", pt_flat, "one dist.all_reduce")
            row("sync", m, "ddp", "Bucketer (MPI)", Stat(g("ddp_bucketer")),
                "%s buckets, size_capped defaults" % info.get("buckets", "?"), pt_sync)
            row("sync", m, "ddp", "Bucketer, matched method (MPI)", Stat(g("ddp_synced_backward"), g("ddp_plain_backward")),
                "synced - plain zero-fill backward", pt_sync)
            row("sync", m, "ddp", "Bucketer zero-copy (MPI)", Stat(g("ddp_bucketer_zero_copy")), "gradient_as_bucket_view", pt_sync)
            row("sync", m, "ddp", README_PATH, Stat(g("ddp_shm_bucketer")),
                "Bucketer defaults over ddp::world(env): shared memory, direct (no bucket copies)", pt_sync)
            row("sync", m, "ddp", "Bucketer over ddp::world, bucket copies", Stat(g("ddp_shm_bucketer_copies")),
                "direct_when_staged = false", pt_sync)
            row("sync", m, "ddp", "Bucketer, contiguous gradients (MPI)", Stat(g("ddp_contiguous_bucketer")),
                "one allocation; %s buckets summed in place" % info.get("contiguous_in_place_buckets", "?"), pt_sync)
            row("sync", m, "ddp", "Bucketer, contiguous gradients (ddp::world)", Stat(g("ddp_contiguous_shm_bucketer")),
                "one allocation; one tensor per bucket, direct", pt_sync)
            row("sync", m, "ddp", "flat allreduce (ddp::mpi)", Stat(g("ddp_flat_allreduce")), "ddp ring", pt_flat)
            row("sync", m, "ddp", "flat allreduce (ddp shm)", Stat(g("ddp_shm_flat_allreduce")), "shared memory", pt_flat)
            row("sync", m, "mpi", "flat allreduce (MPI_Allreduce)", Stat(g("mpi_flat_allreduce")), "Open MPI, in place", pt_flat)
            row("sync", m, "limit", "memcpy of the same bytes", Stat(g("memcpy")), "one copy: the physical limit here")
    if "join" in cases:
        g = lambda n: r.get("join", "small", n)
        pt_over = Stat(g("pytorch_step_join"), g("pytorch_step_bare"))
        pt_exit = Stat(g("pytorch_join_exit"))
        row("join", "small", "pytorch", "step, no join", Stat(g("pytorch_step_bare")), "per iteration")
        row("join", "small", "pytorch", "step inside Join", Stat(g("pytorch_step_join")), "per iteration")
        row("join", "small", "pytorch", "join overhead", pt_over, "per iteration")
        row("join", "small", "pytorch", "Join exit", pt_exit, "once")
        row("join", "small", "ddp", "step, no join", Stat(g("ddp_step_bare")), "per iteration")
        row("join", "small", "ddp", "step with notify()", Stat(g("ddp_step_join")), "per iteration")
        row("join", "small", "ddp", "join overhead", Stat(g("ddp_step_join"), g("ddp_step_bare")), "per iteration", pt_over)
        row("join", "small", "ddp", "JoinContext::finish()", Stat(g("ddp_join_finish")), "once", pt_exit)
    if "buffers" in cases:
        m = models[0]
        g = lambda n: r.get("buffers", m, n)
        info = r.info.get(("buffers", m), {})
        note = "%s buffers, %s bytes" % (info.get("buffers", "?"), info.get("bytes", "?"))
        pt = Stat(g("pytorch_forward_broadcast_buffers"), g("pytorch_forward_no_buffers"))
        row("buffers", m, "pytorch", "broadcast_buffers=True", pt, note + "; forward(True) - forward(False)")
        row("buffers", m, "ddp", "BufferReducer, trainer-owned", Stat(g("ddp_buffers_broadcast_copy")), note, pt)
        row("buffers", m, "ddp", "BufferReducer, emplaced", Stat(g("ddp_buffers_broadcast_view")), note, pt)
    for x in rows:
        ref = x["ref"]
        x["ratio"] = ratio(x["stat"].median, ref.median) if ref else NAN
        x["ratio_best"] = ratio(x["stat"].best, ref.best) if ref else NAN
    return rows


def print_tables(rows, header_lines):
    for line in header_lines:
        print(line)
    titles = {
        "sync": "Gradient synchronisation per step (ms; ratio = ddp / PyTorch DDP sync, or / PyTorch flat for flat rows)",
        "join": "Join: per-iteration cost (ms; small model, 65,792 floats)",
        "buffers": "Buffer sync per step (ms)",
    }
    for table in ("sync", "join", "buffers"):
        sel = [x for x in rows if x["table"] == table]
        if not sel:
            continue
        print("\n" + titles[table])
        cells = [("model", "stack", "measured", "median", "best", "ratio", "ratio(best)", "n", "note")]
        for x in sel:
            st = x["stat"]
            cells.append((x["model"], x["stack"], x["measured"], fmt(st.median, 3), fmt(st.best, 3),
                          fmt(x["ratio"]) if x["ref"] else "", fmt(x["ratio_best"]) if x["ref"] else "", str(st.n), x["note"]))
        widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
        for k, c in enumerate(cells):
            print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
            if k == 0:
                print("  ".join("-" * w for w in widths))


README_PATH = "Bucketer, README path (ddp::world)"


def headline(rows):
    out = []
    for x in rows:
        if x["table"] == "sync" and x["stack"] == "ddp" and x["measured"] in ("Bucketer (MPI)", README_PATH):
            verdict = "faster" if x["ratio"] == x["ratio"] and x["ratio"] < 1 else "NOT faster"
            out.append("%s: ddp %s %s ms vs PyTorch DDP %s ms: ratio %s (best-iteration ratio %s): ddp %s"
                       % (x["model"], x["measured"], fmt(x["stat"].median), fmt(x["ref"].median), fmt(x["ratio"]),
                          fmt(x["ratio_best"]), verdict))
    return out


def headline_ratios(rows, models):
    """--headline: the README path against PyTorch DDP and against the flat shared-memory allreduce."""
    get = lambda m, measured: next((x for x in rows if x["table"] == "sync" and x["model"] == m and x["measured"] == measured), None)
    vs_pytorch, vs_flat = [], []
    for m in models:
        readme, flat = get(m, README_PATH), get(m, "flat allreduce (ddp shm)")
        vs_pytorch.append("%s %s" % (m, fmt(readme["ratio"]) if readme else "nan"))
        vs_flat.append("%s %s" % (m, fmt(ratio(readme["stat"].median, flat["stat"].median)) if readme and flat else "nan"))
    return ["README path / flat shared-memory allreduce of the same bytes (target <= 1.25): " + " ".join(vs_flat),
            "headline ddp/pytorch: " + " ".join(vs_pytorch)]


def machine():
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    model = platform.processor() or "?"
    try:
        out = subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "load": load}


def find_bench():
    for d in ("build-bench", "build/default", "build"):
        p = os.path.join(ROOT, d, "bench", "ddp_vs_pytorch")
        if os.access(p, os.X_OK):
            return p
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torch-python", required=True, help="interpreter that imports torch")
    p.add_argument("--ddp-bench", help="path of the ddp_vs_pytorch program (default: looked up in build dirs)")
    p.add_argument("--mpiexec", default=shutil.which("mpiexec") or "mpiexec")
    p.add_argument("--mpiexec-args", default=None, help="extra launcher arguments (default: --oversubscribe for Open MPI)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--models", default="resnet50,bert_base", help="shapes files in bench/pytorch/shapes/, or paths")
    p.add_argument("--cases", default="sync,join,buffers")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="sync iterations per round and stack")
    p.add_argument("--join-iters", type=int, default=200, help="iterations per join block")
    p.add_argument("--join-rounds", type=int, default=5, help="join blocks of each kind per round")
    p.add_argument("--buffer-iters", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round: proves it runs (ctest)")
    p.add_argument("--out-dir", help="where raw results go (default: a temporary directory)")
    p.add_argument("--csv", help="write the tables as CSV")
    p.add_argument("--hosts", type=int, default=0,
                   help="run both stacks across this many test hosts (ddp-run --hosts; root), ranks by block")
    p.add_argument("--link-rate", help="with --hosts: cap each host's link (a tc rate, e.g. 1gbit)")
    p.add_argument("--headline", action="store_true",
                   help="the README's default path against PyTorch DDP on ResNet-50 and BERT-base gradient shapes "
                        "(sync case only); the last line is 'headline ddp/pytorch: resnet50 <ratio> bert_base <ratio>'")
    args = p.parse_args(argv)
    if args.headline:
        args.cases = "sync"
        if args.models == p.get_default("models"):
            args.models = "resnet50,bert_base"

    if args.quick:
        args.models = os.path.join(HERE, "tiny_shapes.txt")
        args.rounds, args.iters, args.join_iters, args.join_rounds, args.buffer_iters = 1, 3, 5, 2, 5
    args.ddp_bench = args.ddp_bench or find_bench()
    if not args.ddp_bench or not os.access(args.ddp_bench, os.X_OK):
        raise SystemExit("ddp_vs_pytorch not found: build it (cmake --build <dir> --target ddp_vs_pytorch) or pass --ddp-bench")
    if args.mpiexec_args is None:
        try:
            v = subprocess.run([args.mpiexec, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
        except OSError:
            raise SystemExit("mpiexec not found: pass --mpiexec")
        args.mpiexec_args = "--oversubscribe" if "Open MPI" in v or "OpenRTE" in v else ""
    args.mpiexec_args = args.mpiexec_args.split()
    for k, v in (("OMPI_MCA_pml", "ob1"), ("OMPI_MCA_btl", "self,vader")):
        os.environ.setdefault(k, v)
    if os.geteuid() == 0:
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    tmp = None
    if not args.out_dir:
        tmp = tempfile.mkdtemp(prefix="ddp_compare_")
        args.out_dir = tmp
    os.makedirs(args.out_dir, exist_ok=True)

    models = []  # (name, path)
    for item in args.models.split(","):
        path = item if os.path.sep in item else os.path.join(HERE, "shapes", item + ".txt")
        name = os.path.basename(path).split(".")[0]
        if not os.path.exists(path):
            raise SystemExit("no shapes file %s" % path)
        models.append((name, path))
    cases = args.cases.split(",")

    m0 = machine()
    start = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if args.hosts and args.np % args.hosts:
        raise SystemExit("--np %d ranks do not split evenly over --hosts %d" % (args.np, args.hosts))
    where = "" if not args.hosts else ", across %d test hosts%s" % (
        args.hosts, " at " + args.link_rate if args.link_rate else " (links uncapped)")
    print("ddp vs PyTorch DDP: %d ranks%s, %d round(s), %s" % (args.np, where, args.rounds, start))
    print("machine: %s CPUs (%s), load average at start %.2f %.2f %.2f" % (m0["cpus"], m0["cpu_model"], *m0["load"]))
    r = Runner(args)
    for k in range(args.rounds):
        print("round %d/%d" % (k + 1, args.rounds))
        if "sync" in cases:
            for name, path in models:
                r.both(k, "sync", name, path, ["--iters", str(args.iters), "--warmup", "3"], ["--iters", str(args.iters), "--warmup", "3"])
        if "join" in cases:
            j = ["--iters", str(args.join_iters), "--rounds", str(args.join_rounds), "--warmup", "20"]
            r.both(k, "join", "small", None, j, j)
        if "buffers" in cases:
            name, path = models[0]
            b = ["--iters", str(args.buffer_iters), "--warmup", "10"]
            r.both(k, "buffers", name, path, b, b)
    m1 = machine()
    rows = build_tables(r, [n for n, _ in models], cases)
    meta = r.info.get(("meta", ""), {})
    header = [
        "",
        "=" * 100,
        "ddp vs PyTorch DDP | %s | %d ranks%s | torch %s (%s) | ddp: %s" % (start, args.np, where, meta.get("torch", "?"), meta.get("python", "?"), args.ddp_bench),
        "machine: %s CPUs (%s); load average %.2f at start, %.2f at end (1 min)" % (m0["cpus"], m0["cpu_model"], m0["load"][0], m1["load"][0]),
        "every sample: slowest rank of one iteration; the stacks ran alternately, never together",
    ]
    print_tables(rows, header)
    print()
    for line in headline(rows):
        print(line)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["table", "model", "stack", "measured", "median_ms", "best_ms", "ratio", "ratio_best", "n", "note"])
            num = lambda v: "" if v != v else "%.4f" % v
            for x in rows:
                st = x["stat"]
                w.writerow([x["table"], x["model"], x["stack"], x["measured"], num(st.median), num(st.best),
                            num(x["ratio"]), num(x["ratio_best"]), st.n, x["note"]])
        print("csv: %s" % args.csv)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print("raw samples: %s" % args.out_dir)
    if args.headline:
        print("load average at end (1 min): %.2f" % os.getloadavg()[0])
        for line in headline_ratios(rows, [n for n, _ in models]):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
