#!/usr/bin/env python3
"""tpnorm's CPU ops against the same ops in oneDNN and PyTorch: `./launch/tpnorm perf --peers`.

  peers.py --micro BUILD/bench/cpu/tpnorm_micro [--torch PYTHON ...] [--quick]
           [--shapes REGEX] [--threads 1,2] [--rounds N] [--repetitions N] [--min-time S]
           [--json FILE]

Needs no torch itself. It runs, in one window:
  1. `tpnorm_micro --peers_info` (which oneDNN, or why none) and `tpnorm_micro --peers_ref=DIR`
     (tpnorm's result on every problem the --shapes regex matches on "OP/PASS/SHAPE");
  2. --rounds rounds, each in a random order: tpnorm_micro --peers on tpnorm's cases and oneDNN's
     (--repetitions interleaved at random, every repetition kept), and peers_torch.py under each
     torch (the same repetitions, also in a random order);
  3. one table of the medians over every repetition of every round: GB/s of the op's minimum
     traffic (forward reads x and writes y, backward reads x and dy and writes dx), higher is
     better; best peer = the fastest peer whose output matched tpnorm's; tpnorm/best = tpnorm's
     GB/s over it.
Every peer's output is checked against tpnorm's on the same inputs before it is timed (peers.h);
a peer that differs is printed as an error, still timed, marked `!` and not counted as best.
The torches: by default Debian's /usr/bin/python3 and the venv that launch/python-env.sh names
(`launch/python-env.sh python`); --torch PYTHON (repeatable) names them instead. The torch
processes run with glibc's malloc kept off mmap (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_ huge)
so that the outputs torch allocates per call reuse freed memory instead of faulting fresh pages
in on every call, as tpnorm's and oneDNN's preallocated outputs are; --torch-fresh-pages leaves
malloc alone. Exit status 0 when every peer's output matched, 1 when one differed, 2 on errors.
"""
import argparse
import datetime
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def die(msg):
    print("peers: error: " + msg, file=sys.stderr)
    sys.exit(2)


def run(cmd, env=None, quiet=True):
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE if quiet else None,
                       stderr=subprocess.PIPE, text=True)
    sys.stderr.write("".join(l + "\n" for l in r.stderr.splitlines() if l.startswith("error:")))
    return r


def cpu_model():
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" in line:
                    k, v = (s.strip() for s in line.split(":", 1))
                    info.setdefault(k, v)
    except OSError:
        return "unknown CPU"
    flags = info.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return "%s (family %s model %s, %s), %d CPUs" % (
        info.get("model name", "?"), info.get("cpu family", "?"), info.get("model", "?"), isa,
        os.cpu_count() or 0)


def torch_columns(args):
    """[(python, label or None, why skipped or None)] in column order."""
    cols = []
    pys = args.torch
    if not pys:
        pys = ["/usr/bin/python3"]
        venv = ""
        try:
            venv = subprocess.run([os.path.join(ROOT, "launch", "python-env.sh"), "python"],
                                  stdout=subprocess.PIPE, text=True).stdout.strip()
        except OSError:
            pass
        pys.append(venv or None)
    for py in pys:
        if py is None:
            cols.append((None, "torch (PyPI)", "skipped: no venv with the PyPI torch "
                         "(launch/python-env.sh ensure makes one; TPNORM_TORCH_VENV names it)"))
            continue
        r = subprocess.run([py, "-c", "import torch; print(torch.__version__)"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            cols.append((None, "torch (%s)" % py, "skipped: %s cannot import torch" % py))
            continue
        v = r.stdout.strip()
        short = ".".join(v.split("+")[0].split(".")[:2])
        label = "torch " + short
        if any(c[1] == label for c in cols):
            label = "torch " + v
        cols.append((py, label, None, v))
    return [c if len(c) == 4 else c + (None,) for c in cols]


def median_or_none(v):
    return statistics.median(v) if v else None


def main():
    ap = argparse.ArgumentParser(
        prog="peers.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("--micro", default=os.path.join(ROOT, "build", "bench", "cpu", "tpnorm_micro"),
                    help="the tpnorm_micro binary (default: build/bench/cpu/tpnorm_micro)")
    ap.add_argument("--torch", action="append", metavar="PYTHON",
                    help="an interpreter whose torch gets a column (repeatable)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: one round, one repetition, 0.01 s each (timings mean little)")
    ap.add_argument("--shapes", default=".",
                    help="regex on OP/PASS/SHAPE, e.g. '4096x512|32x64x56x56' (default: all)")
    ap.add_argument("--threads", default="1,2", help="1, 2 or 1,2 (default 1,2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every program (default 3)")
    ap.add_argument("--repetitions", type=int, default=1,
                    help="repetitions of each case per round (default 1)")
    ap.add_argument("--min-time", type=float, default=0.1,
                    help="seconds per repetition (default 0.1)")
    ap.add_argument("--torch-fresh-pages", action="store_true",
                    help="leave torch's malloc as it is (its per-call outputs fault pages in)")
    ap.add_argument("--json", metavar="FILE", help="also write the merged results as JSON")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.repetitions, args.min_time = 1, 1, 0.01
    threads = [int(t) for t in args.threads.split(",")]
    if not threads or any(t not in (1, 2) for t in threads):
        die("--threads takes 1, 2 or 1,2 (tpnorm_micro times those)")
    if not os.access(args.micro, os.X_OK):
        die("no %s (./launch/tpnorm build makes it)" % args.micro)
    try:
        re.compile(args.shapes)
    except re.error as e:
        die("--shapes: %s" % e)

    r = run([args.micro, "--peers_info"])
    if r.returncode != 0:
        die("%s --peers_info failed:\n%s" % (args.micro, r.stderr))
    infos = dict(l.split("\t", 1) for l in r.stdout.splitlines() if "\t" in l)
    onednn = infos.get("oneDNN", "skipped: this tpnorm_micro has no oneDNN peer")
    have_onednn = not onednn.startswith("skipped")
    torches = torch_columns(args)

    tmp = tempfile.mkdtemp(prefix="tpnorm-peers-")
    try:
        return measure(args, threads, onednn, have_onednn, torches, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(args, threads, onednn, have_onednn, torches, tmp):
    ref = os.path.join(tmp, "ref")
    os.mkdir(ref)
    r = run([args.micro, "--peers_ref=" + ref, "--peers_filter=" + args.shapes])
    if r.returncode != 0:
        die("%s --peers_ref failed:\n%s" % (args.micro, r.stderr))
    problems = []  # (op, pass, shape, layout) in the table's order
    with open(os.path.join(ref, "manifest.txt")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            key, layout = line.split()[:2]
            p = tuple(key.split("/")) + (layout,)
            if p not in problems:
                problems.append(p)
    if not problems:
        die("--shapes '%s' matches no problem" % args.shapes)
    shapes = sorted({p[2] for p in problems})
    ops = sorted({p[0] for p in problems})
    passes = sorted({p[1] for p in problems})
    thr = "|".join(str(t) for t in threads)
    micro_filter = "^(peer/oneDNN/)?(%s)/(%s)/(%s)/threads:(%s)(/real_time)?$" % (
        "|".join(ops), "|".join(passes), "|".join(shapes), thr)

    env_torch = dict(os.environ)
    env_torch.pop("OMP_NUM_THREADS", None)  # torch.set_num_threads decides
    if not args.torch_fresh_pages:
        env_torch.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    samples = {}  # benchmark name -> [GB/s]
    marks = {}  # benchmark name -> mismatch / error text
    notes = {}  # (lib label, op, pass) -> note
    skipped = {}  # benchmark name -> reason

    def micro_round(k):
        out = os.path.join(tmp, "micro-%d.json" % k)
        r = run([args.micro, "--peers", "--benchmark_filter=" + micro_filter,
                 "--benchmark_repetitions=%d" % args.repetitions,
                 "--benchmark_min_time=%g" % args.min_time,
                 "--benchmark_enable_random_interleaving=true",
                 "--benchmark_out=" + out, "--benchmark_out_format=json"])
        if r.returncode != 0 or not os.path.exists(out):
            die("tpnorm_micro failed (status %d):\n%s" % (r.returncode, r.stderr[-3000:]))
        with open(out) as f:
            for b in json.load(f)["benchmarks"]:
                name = b.get("run_name", b["name"])
                if name.endswith("/real_time"):
                    name = name[:-len("/real_time")]
                if b.get("error_occurred"):
                    marks[name] = "error: " + b.get("error_message", "")
                    continue
                if b.get("run_type", "iteration") != "iteration":
                    continue
                if b.get("label", "").startswith("MISMATCH"):
                    marks[name] = b["label"]
                samples.setdefault(name, []).append(b["bytes_per_second"] / 1e9)

    def torch_round(k, col):
        py, label = col[0], col[1]
        out = os.path.join(tmp, "torch-%d-%s.json" % (k, label.replace(" ", "_")))
        r = run([py, os.path.join(HERE, "peers_torch.py"), "--ref", ref, "--threads",
                 ",".join(str(t) for t in threads), "--repetitions", str(args.repetitions),
                 "--min-time", str(args.min_time), "--lib", label, "--out", out,
                 "--seed", str(k)], env=env_torch)
        if r.returncode != 0 or not os.path.exists(out):
            die("peers_torch.py under %s failed (status %d):\n%s" % (py, r.returncode,
                                                                     r.stderr[-3000:]))
        with open(out) as f:
            res = json.load(f)["results"]
        for name, cell in res.items():
            if "skipped" in cell:
                skipped[name] = cell["skipped"]
                continue
            if "mismatch" in cell:
                marks[name] = "MISMATCH: " + cell["mismatch"]
            samples.setdefault(name, []).extend(cell["gbps"])
            op, pas = name.split("/")[2:4]
            notes[(label, op, pas)] = cell.get("note", "")

    live = [c for c in torches if c[0]]
    for k in range(args.rounds):
        progs = [("micro", None)] + [("torch", c) for c in live]
        random.Random(1000 + k).shuffle(progs)
        for kind, col in progs:
            print("peers: round %d/%d: %s" % (k + 1, args.rounds, "tpnorm_micro (tpnorm, oneDNN)"
                                              if kind == "micro" else col[1]), file=sys.stderr)
            micro_round(k) if kind == "micro" else torch_round(k, col)

    # The table.
    peer_cols = [("oneDNN", onednn if not have_onednn else None)] + [
        (c[1], c[2]) for c in torches]
    head = ["op", "pass", "shape", "layout", "thr", "tpnorm"] + [c[0] for c in peer_cols] + [
        "best peer", "tpnorm/best"]
    rows, results = [], []
    n_checked = n_bad = n_err = 0
    for op, pas, shape, layout in problems:
        for t in threads:
            key = "%s/%s/%s/threads:%d" % (op, pas, shape, t)
            tp = median_or_none(samples.get(key, []))
            cells, best, best_lib = [], None, None
            rec = {"op": op, "pass": pas, "shape": shape, "layout": layout, "threads": t,
                   "tpnorm": tp, "peers": {}}
            for lib, why in peer_cols:
                name = "peer/%s/%s" % (lib, key)
                if why:
                    cells.append("-")
                    rec["peers"][lib] = {"skipped": why}
                    continue
                if lib == "oneDNN" and op == "RMSNorm":
                    cells.append("n/a")
                    rec["peers"][lib] = {"skipped": "n/a: oneDNN 2.x has no RMS normalization"}
                    continue
                if name in skipped:
                    cells.append("n/a")
                    rec["peers"][lib] = {"skipped": skipped[name]}
                    continue
                g = median_or_none(samples.get(name, []))
                mark = marks.get(name)
                rec["peers"][lib] = {"gbps": g, "check": mark or "passed"}
                if mark and mark.startswith("error"):
                    cells.append("err")
                    n_err += 1
                    continue
                n_checked += 1
                if mark:
                    n_bad += 1
                cells.append("%.1f%s" % (g, "!" if mark else "") if g is not None else "?")
                if g is not None and not mark and (best is None or g > best):
                    best, best_lib = g, lib
            rec["best_peer"] = best_lib
            rec["tpnorm_over_best"] = tp / best if tp and best else None
            results.append(rec)
            rows.append([op, pas, shape, layout, str(t), "%.1f" % tp if tp else "?"] + cells + [
                "%s %.1f" % (best_lib, best) if best else "-",
                "%.2f" % (tp / best) if tp and best else "-"])
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(v.ljust(w) if i < 4 else v.rjust(w)
                              for i, (v, w) in enumerate(zip(r, widths)))
    print("tpnorm against oneDNN and PyTorch, fp32, GB/s of the op's minimum traffic (median of "
          "%d samples: %d rounds x %d repetitions, %g s each)" % (
              args.rounds * args.repetitions, args.rounds, args.repetitions, args.min_time))
    print("%s; %s UTC; oneDNN %s; %s" % (
        cpu_model(), datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), onednn,
        "; ".join("%s: %s" % (c[1], c[3] or c[2]) for c in torches)))
    print()
    print(fmt(head))
    for r in rows:
        print(fmt(r))
    print()
    print("GB/s: bytes = forward x + y, backward x + dy + dx; 1 thread timed by its CPU time, 2 "
          "threads by wall time; higher is better.")
    print("best peer: the fastest peer whose output matched tpnorm's; tpnorm/best = tpnorm GB/s "
          "/ best peer GB/s (> 1: tpnorm is faster).")
    print("!: the peer's output differs from tpnorm's beyond the tolerance (error above), timed "
          "but not counted. n/a: the library has no such op. -: the column is skipped.")
    for lib, why in peer_cols:
        if why:
            print("%s: %s" % (lib, why))
    if have_onednn:
        print("oneDNN: layer_normalization / batch_normalization primitives, outputs and scratchpad "
              "preallocated; RMSNorm n/a (oneDNN 2.x has no RMS normalization).")
    for c in live:
        by_note = {}
        for (lib, op, pas), n in sorted(notes.items()):
            if lib == c[1] and n:
                by_note.setdefault(n, []).append("%s %s" % (op, pas))
        why_na = sorted({"%s %s" % (name.split("/")[2], why) for name, why in skipped.items()
                         if name.split("/")[1] == c[1]})
        print("%s: %s." % (c[1], "; ".join(["%s (%s)" % (n, ", ".join(w))
                                            for n, w in by_note.items()] + why_na)))
    if not args.torch_fresh_pages and live:
        print("torch runs with MALLOC_MMAP_MAX_=0 so that outputs it allocates per call reuse "
              "freed memory (--torch-fresh-pages: without).")
    if n_bad or n_err:
        print("checks: FAILED: %d of %d peer outputs differ from tpnorm's (marked !), %d peer "
              "cells failed to run (err)." % (n_bad, n_checked, n_err))
    else:
        print("checks: passed: all %d peer outputs matched tpnorm's." % n_checked)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"onednn": onednn, "torch": {c[1]: c[3] or c[2] for c in torches},
                       "cpu": cpu_model(), "rows": results}, f, indent=1)
    return 2 if n_err else 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
