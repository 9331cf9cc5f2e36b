#!/usr/bin/env python3
"""Side-by-side benchmark, ddp vs PyTorch DDP, in one run (started by bench/compare_pytorch.sh).

For each round, for each model, the PyTorch worker (bench/pytorch/ddp_worker.py, under the
interpreter that has torch) and the ddp program (bench/ddp_vs_pytorch, under mpiexec) run one
after the other, never at the same time; the order alternates between rounds, so slow phases of a
shared machine hit both stacks alike. Every sample is the slowest rank's time of one iteration.
At the end it prints the tables (medians over all rounds, ratios ddp / PyTorch) and, with
--csv, writes the same numbers as CSV. Needs no torch itself (it only starts the worker).

Derived figures (docs/benchmarks.md):
  PyTorch DDP sync   median over iterations of (DDP backward - plain backward); the two run
                     back to back in each iteration, so the difference pairs like conditions
  join overhead      median over blocks of (per-iteration time with join - without)
  buffer sync        PyTorch: median of (forward with broadcast_buffers - without);
                     ddp: median time of BufferReducer::sync()
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
ROOT = os.path.dirname(os.path.dirname(HERE))


def median(v):
    return statistics.median(v) if v else float("nan")


def paired(a, b):
    """Median of element-wise differences a[i] - b[i]."""
    return median([x - y for x, y in zip(a, b)])


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
        self.info.setdefault((case, model), {}).update(data.get("info", {}))
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
        if shapes:
            cmd += ["--shapes", shapes]
        self.run(cmd + extra, "PyTorch %s %s" % (case, model))
        self.record(case, model, out)

    def ddp(self, case, model, shapes, extra):
        out = os.path.join(self.args.out_dir, "ddp_%s_%s.json" % (case, model))
        cmd = [self.args.mpiexec, "-n", str(self.args.np)] + self.args.mpiexec_args + [self.args.ddp_bench, case, "--json", out]
        if shapes:
            cmd += ["--shapes", shapes, "--model", model]
        self.run(cmd + extra, "ddp     %s %s" % (case, model))
        self.record(case, model, out)

    def both(self, round_index, case, model, shapes, pt_extra, ddp_extra):
        steps = [lambda: self.pytorch(case, model, shapes, pt_extra), lambda: self.ddp(case, model, shapes, ddp_extra)]
        if round_index % 2:
            steps.reverse()
        for s in steps:
            s()

    def get(self, case, model, name):
        return self.samples.get((case, model, name), [])


def build_tables(r, models, cases):
    """Rows of (table, model, stack, measured, median_ms, ratio, n, note)."""
    rows = []
    if "sync" in cases:
        for m in models:
            g = lambda n: r.get("sync", m, n)
            pt_plain, pt_ddp, pt_flat = g("pytorch_plain_backward"), g("pytorch_ddp_backward"), g("pytorch_flat_allreduce")
            dd, df, mf = g("ddp_bucketer"), g("ddp_flat_allreduce"), g("mpi_flat_allreduce")
            dd_matched = paired(g("ddp_synced_backward"), g("ddp_plain_backward"))
            info = r.info.get(("sync", m), {})
            pt_sync = paired(pt_ddp, pt_plain)
            note_b = "%s buckets" % info.get("buckets", "?")
            rows += [
                ("sync", m, "pytorch", "ddp_sync (ddp - plain backward)", pt_sync, float("nan"), len(pt_ddp), "gloo, bucket_cap_mb=25"),
                ("sync", m, "pytorch", "ddp_backward", median(pt_ddp), float("nan"), len(pt_ddp), ""),
                ("sync", m, "pytorch", "plain_backward", median(pt_plain), float("nan"), len(pt_plain), ""),
                ("sync", m, "pytorch", "flat_allreduce", median(pt_flat), float("nan"), len(pt_flat), "one dist.all_reduce, gloo"),
                ("sync", m, "ddp", "bucketer", median(dd), ratio(median(dd), pt_sync), len(dd), note_b + ", size_capped defaults, MPI"),
                ("sync", m, "ddp", "bucketer_zero_copy", median(g("ddp_bucketer_zero_copy")), ratio(median(g("ddp_bucketer_zero_copy")), pt_sync), len(g("ddp_bucketer_zero_copy")), "zero_copy = true (gradient_as_bucket_view)"),
                ("sync", m, "ddp", "bucketer_backward_matched", dd_matched, ratio(dd_matched, pt_sync), len(g("ddp_synced_backward")), "synced - plain zero-fill backward (PyTorch's method)"),
                ("sync", m, "ddp", "flat_allreduce", median(df), ratio(median(df), median(pt_flat)), len(df), "ddp::mpi::communicator"),
                ("sync", m, "mpi", "flat_allreduce", median(mf), ratio(median(mf), median(pt_flat)), len(mf), "raw MPI_Allreduce"),
            ]
    if "join" in cases:
        g = lambda n: r.get("join", "small", n)
        pt_over = paired(g("pytorch_step_join"), g("pytorch_step_bare"))
        dd_over = paired(g("ddp_step_join"), g("ddp_step_bare"))
        rows += [
            ("join", "small", "pytorch", "step_bare", median(g("pytorch_step_bare")), float("nan"), len(g("pytorch_step_bare")), "per iteration"),
            ("join", "small", "pytorch", "step_join", median(g("pytorch_step_join")), float("nan"), len(g("pytorch_step_join")), "inside Join([ddp])"),
            ("join", "small", "pytorch", "join_overhead", pt_over, float("nan"), len(g("pytorch_step_join")), "per iteration"),
            ("join", "small", "pytorch", "join_exit", median(g("pytorch_join_exit")), float("nan"), len(g("pytorch_join_exit")), "Join.__exit__"),
            ("join", "small", "ddp", "step_bare", median(g("ddp_step_bare")), float("nan"), len(g("ddp_step_bare")), "per iteration"),
            ("join", "small", "ddp", "step_join", median(g("ddp_step_join")), float("nan"), len(g("ddp_step_join")), "notify() each iteration"),
            ("join", "small", "ddp", "join_overhead", dd_over, ratio(dd_over, pt_over), len(g("ddp_step_join")), "per iteration"),
            ("join", "small", "ddp", "join_finish", median(g("ddp_join_finish")), ratio(median(g("ddp_join_finish")), median(g("pytorch_join_exit"))), len(g("ddp_join_finish")), "JoinContext::finish()"),
        ]
    if "buffers" in cases:
        m = models[0]
        g = lambda n: r.get("buffers", m, n)
        pt = paired(g("pytorch_forward_broadcast_buffers"), g("pytorch_forward_no_buffers"))
        info = r.info.get(("buffers", m), {})
        note = "%s buffers" % info.get("buffers", "?")
        rows += [
            ("buffers", m, "pytorch", "broadcast_buffers", pt, float("nan"), len(g("pytorch_forward_broadcast_buffers")), note + ", forward(True) - forward(False)"),
            ("buffers", m, "ddp", "buffer_reducer_copy", median(g("ddp_buffers_broadcast_copy")), ratio(median(g("ddp_buffers_broadcast_copy")), pt), len(g("ddp_buffers_broadcast_copy")), note + ", trainer-owned"),
            ("buffers", m, "ddp", "buffer_reducer_view", median(g("ddp_buffers_broadcast_view")), ratio(median(g("ddp_buffers_broadcast_view")), pt), len(g("ddp_buffers_broadcast_view")), note + ", emplaced"),
        ]
    return rows


def print_tables(rows, header_lines):
    for line in header_lines:
        print(line)
    titles = {
        "sync": "Gradient synchronisation per step (ms, median; ratio = ddp / PyTorch)",
        "join": "Join: per-iteration cost (ms, median; small model, 65,792 floats)",
        "buffers": "Buffer sync per step (ms, median)",
    }
    for table in ("sync", "join", "buffers"):
        sel = [r for r in rows if r[0] == table]
        if not sel:
            continue
        print("\n" + titles[table])
        cells = [("model", "stack", "measured", "median_ms", "ratio", "n", "note")]
        cells += [(r[1], r[2], r[3], fmt(r[4], 3), fmt(r[5], 2) if r[5] == r[5] else "", str(r[6]), r[7]) for r in sel]
        widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
        for k, c in enumerate(cells):
            print("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
            if k == 0:
                print("  ".join("-" * w for w in widths))


def headline(rows):
    out = []
    for r in rows:
        if r[0] == "sync" and r[2] == "ddp" and r[3] == "bucketer":
            pt = [x for x in rows if x[0] == "sync" and x[1] == r[1] and x[2] == "pytorch" and x[3].startswith("ddp_sync")][0]
            verdict = "faster" if r[5] == r[5] and r[5] < 1 else "NOT faster"
            out.append("%s: ddp Bucketer %s ms vs PyTorch DDP %s ms -> ratio %s (ddp %s)" % (r[1], fmt(r[4]), fmt(pt[4]), fmt(r[5]), verdict))
    return out


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
    args = p.parse_args(argv)

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
    print("ddp vs PyTorch DDP: %d ranks, %d round(s), %s" % (args.np, args.rounds, start))
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
        "ddp vs PyTorch DDP | %s | %d ranks | torch %s (%s) | ddp: %s" % (start, args.np, meta.get("torch", "?"), meta.get("python", "?"), args.ddp_bench),
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
            w.writerow(["table", "model", "stack", "measured", "median_ms", "ratio_ddp_over_pytorch", "n", "note"])
            for row in rows:
                w.writerow([row[0], row[1], row[2], row[3], "%.4f" % row[4], "" if row[5] != row[5] else "%.4f" % row[5], row[6], row[7]])
        print("csv: %s" % args.csv)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print("raw samples: %s" % args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
