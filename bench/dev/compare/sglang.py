"""Our RadixCache against SGLang's radix caches, side by side, on the same seeded workloads.

    python -m bench compare --reps 3
    python -m bench compare --reps 5 --impls radix unified-rust --workloads sysprompt
    python -m bench compare --anchor-python /path/to/venv/bin/python --json out.json

Runs an SGLang-side bench script (``--anchor-script`` or ``HPC_SGLANG_ANCHOR_SCRIPT``; it is not
part of this repository: it takes ``--impl IMPL --workload W --page-size P --policy NAME`` and
prints one JSON line) in the anchor venv (SGLang 0.5.23, built by ``.ci/sglang-anchor-up``;
default ``/tmp/sglang-anchor``) and ``python -m bench radix-ops`` back to
back, one process per run, interleaved: every repetition runs every configuration once, and
odd repetitions run them in reverse order, so drifting machine load hits both sides alike.
Each SGLang run is paired with our run of the same repetition and workload (KV-only impls
with our KV-only cache, ``*-mamba-*`` impls with ``--states``); the table shows the median
over repetitions of ``ours / theirs`` per operation (> 1: we are faster).

Our side runs twice per repetition, with the anchor's allocator convention (``counter``:
fresh ids from a counter, ``free`` only counts) and with our real allocators (``real``:
``evict`` then includes the allocator's bookkeeping of the freed slots).

Memory (``--memory``, on by default): for each workload, the bytes a cache holds per cached
token, measured as the memory released when the cache object is dropped at the end of the
workload, divided by the tokens it holds then. Two measures, each in its own process:
``malloc`` (``PYTHONMALLOC=malloc`` and glibc ``mallinfo2``: every byte, Python objects,
tensor storage, Rust) and ``tracemalloc`` (the Python heap only: tensor storage and the Rust
core's memory are invisible to it).

Without the anchor venv (or ``--anchor-python``) or the SGLang-side script, the SGLang side is
skipped with a message and only our figures are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from bench.cli import new_parser, output_path

REPO = Path(__file__).resolve().parents[3]
DEFAULT_ANCHOR_PYTHON = os.environ.get("HPC_SGLANG_ANCHOR_PYTHON", "/tmp/sglang-anchor/bin/python")
#: The SGLang-side bench script (not in this repository; "" when none is given).
DEFAULT_ANCHOR_SCRIPT = os.environ.get("HPC_SGLANG_ANCHOR_SCRIPT", "")
#: The import-time stand-ins for triton / torchvision the anchor venv imports first.
ANCHOR_DIR = Path(os.environ.get("HPC_SGLANG_ANCHOR_DIR", REPO / "tests" / "sglang" / "anchor"))
ALL_IMPLS = ["radix", "unified-python", "unified-rust", "unified-mamba-python", "unified-mamba-rust"]
DEFAULT_IMPLS = ["radix", "unified-python", "unified-rust", "unified-mamba-rust"]
SHORT = {
    "radix": "RadixCache (Py)",
    "unified-python": "Unified (Py core)",
    "unified-rust": "Unified (Rust core)",
    "unified-mamba-python": "Unified+Mamba (Py core)",
    "unified-mamba-rust": "Unified+Mamba (Rust core)",
}
OPS = [
    ("match+indices", "match_plus_indices_ops_s"),
    ("match only", "match_prefix_ops_s"),
    ("insert", "insert_ops_s"),
    ("lock+unlock", "lock_unlock_pairs_s"),
    ("evict (KV)", "evict_ops_s"),
    ("evict (states)", "mamba_evict_ops_s"),
]
ALLOCS = ["counter", "real"]


def is_state_impl(impl: str) -> bool:
    return "mamba" in impl


# ------------------------------------------------------------------ running
def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in output:\n{text[-2000:]}")


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> dict[str, Any]:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if env:
        full_env.update(env)
    p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=cwd)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return _last_json(p.stdout)


#: Runs a module or a script with its ``time.perf_counter`` replaced by ``time.thread_time``, so
#: the per-operation timers of both benches count this thread's CPU time (a process preempted
#: on a shared machine is not charged for the wait). Arguments: "module"|"path", target, args.
CPU_CLOCK = (
    "import runpy, sys, time; time.perf_counter = time.thread_time; kind, target = sys.argv[1:3]; "
    "sys.argv = [target] + sys.argv[3:]; "
    "runpy.run_module(target, run_name='__main__') if kind == 'module' else "
    "runpy.run_path(target, run_name='__main__')"
)


def _clocked(python: str, kind: str, target: str, args: argparse.Namespace) -> list[str]:
    if args.clock == "cpu":
        return [python, "-c", CPU_CLOCK, kind, target]
    return [python, "-m", target] if kind == "module" else [python, target]


def ours_cmd(workload: str, states: bool, alloc: str, args: argparse.Namespace) -> list[str]:
    cmd = _clocked(sys.executable, "module", "bench.dev.compare.radix_ops", args) + [
        "--workload", workload, "--allocator", alloc, "--page-size", str(args.page_size),
        "--policy", args.policy]
    if states:  # like for like: SGLang's rules for a node left without a state
        cmd += ["--states", "--sglang-rules"]
    return cmd + args.extra


def anchor_cmd(impl: str, workload: str, args: argparse.Namespace) -> list[str]:
    return _clocked(args.anchor_python, "path", str(args.anchor_script), args) + [
        "--impl", impl, "--workload", workload, "--page-size", str(args.page_size),
        "--policy", args.policy] + args.extra


def anchor_available(args: argparse.Namespace) -> str | None:
    """``None`` when the anchor can run, else why not: the venv and the script exist and the
    venv imports SGLang's radix caches (checked before a long run starts, in seconds)."""
    if not Path(args.anchor_python).exists():
        return (f"SGLang anchor venv not found: {args.anchor_python} does not exist "
                "(build it with .ci/sglang-anchor-up, or pass --anchor-python PATH); "
                "skipping the SGLang side")
    if not args.anchor_script:
        return ("no SGLang-side bench script (not part of this repository: pass --anchor-script "
                "PATH or set HPC_SGLANG_ANCHOR_SCRIPT); skipping the SGLang side")
    if not Path(args.anchor_script).exists():
        return f"anchor script not found: {args.anchor_script} (pass --anchor-script PATH)"
    probe = (f"import sys; sys.path.insert(0, {str(ANCHOR_DIR)!r}); import sglang_cpu_shim; "
             "import sglang.srt.mem_cache.radix_cache, sglang.srt.mem_cache.unified_radix_cache")
    try:
        p = subprocess.run([args.anchor_python, "-c", probe], capture_output=True, text=True,
                           timeout=300)
    except subprocess.TimeoutExpired:
        return "the anchor venv did not import SGLang's caches within 300 s; skipping the SGLang side"
    if p.returncode != 0:
        return (f"the anchor venv cannot import SGLang's caches ({p.stderr.strip()[-300:]}); "
                "skipping the SGLang side")
    return None


def plan(args: argparse.Namespace, with_anchor: bool) -> list[tuple[str, str, Any]]:
    """The run order of one repetition: (side, workload, config) triples, ours and theirs
    alternating within each workload."""
    out: list[tuple[str, str, Any]] = []
    for w in args.workloads:
        ours = [(s, a) for s in ([False, True] if args.states_too else [False]) for a in ALLOCS]
        theirs = list(args.impls) if with_anchor else []
        seq: list[tuple[str, str, Any]] = []
        while ours or theirs:
            if ours:
                seq.append(("ours", w, ours.pop(0)))
            if theirs:
                seq.append(("sglang", w, theirs.pop(0)))
        out.extend(seq)
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_reps(args: argparse.Namespace, with_anchor: bool) -> dict[tuple, list[dict[str, Any]]]:
    """results[(side, workload, config)] = one JSON per repetition."""
    results: dict[tuple, list[dict[str, Any]]] = {}
    order = plan(args, with_anchor)
    for rep in range(args.reps):
        seq = order if rep % 2 == 0 else order[::-1]
        for i, (side, w, cfg) in enumerate(seq):
            if side == "ours":
                states, alloc = cfg
                cmd = ours_cmd(w, states, alloc, args)
                name = f"ours {'KV+state' if states else 'KV'} {alloc}"
            else:
                cmd = anchor_cmd(cfg, w, args)
                name = f"sglang {cfg}"
            t0 = time.perf_counter()
            res = _run(cmd)
            log(f"[rep {rep + 1}/{args.reps} {i + 1:2d}/{len(seq)}] {w:9s} {name:28s} "
                f"{time.perf_counter() - t0:5.1f}s  hit {res['hit_rate']}")
            results.setdefault((side, w, cfg), []).append(res)
    return results


# ------------------------------------------------------------------ tables
def _fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}x"


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x / 1000:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M"


def _median(vals: list[float]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def ratio_table(results: dict, args: argparse.Namespace, alloc: str) -> str:
    impls = list(args.impls)
    head = "| workload | op | " + " | ".join(f"ours / {SHORT[i]}" for i in impls) + " |"
    lines = [head, "|" + "---|" * (2 + len(impls))]
    for w in args.workloads:
        for op, field in OPS:
            cells = []
            for impl in impls:
                theirs = results.get(("sglang", w, impl), [])
                ours = results.get(("ours", w, (is_state_impl(impl), alloc)), [])
                pairs = [
                    o[field] / t[field]
                    for o, t in zip(ours, theirs, strict=False)
                    if o.get(field) and t.get(field)
                ]
                cells.append(_fmt_ratio(_median(pairs)))
            if all(c == "–" for c in cells):
                continue
            lines.append(f"| {w} | {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rate_table(results: dict, args: argparse.Namespace) -> str:
    cols = [("ours", (s, a)) for s in ([False, True] if args.states_too else [False])
            for a in ALLOCS] + [("sglang", i) for i in args.impls]
    present = {(k[0], k[2]) for k in results}
    cols = [c for c in cols if c in present]

    def name(side: str, cfg: Any) -> str:
        if side == "ours":
            return f"ours {'KV+state' if cfg[0] else 'KV'} ({cfg[1]})"
        return SHORT[cfg]

    lines = ["| workload | op | " + " | ".join(name(*c) for c in cols) + " |",
             "|" + "---|" * (2 + len(cols))]
    for w in args.workloads:
        for op, field in OPS + [("hit rate", "hit_rate")]:
            cells = []
            for side, cfg in cols:
                runs = results.get((side, w, cfg), [])
                v = _median([r.get(field) for r in runs])
                cells.append(("–" if v is None else f"{v:.4f}") if field == "hit_rate"
                             else _fmt_rate(v))
            if all(c == "–" for c in cells):
                continue
            lines.append(f"| {w} | {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: What both sides report and must agree on, run for run: the hit rate, the tree's final size
#: and every eviction and checkpoint count (``mamba_*`` on the KV + state runs only).
SAME_WORK = ("hit_rate", "final_nodes", "evict_calls", "evicted_tokens", "mamba_evict_calls",
             "mamba_states_evicted", "mamba_branch_checkpoint_inserts")


def hit_rate_check(results: dict, args: argparse.Namespace) -> list[str]:
    """Both sides must do the same work: our KV-only cache against SGLang's ``RadixCache``,
    our KV + state cache (under SGLang's tree rules) against each Mamba cache run, on every
    field of :data:`SAME_WORK` both report (the hit rate to the fourth decimal; a field a side
    leaves out or reports as ``null``, such as the Rust cores' ``final_nodes``, is not
    compared). One line per pair, ending in ``EQUAL`` or ``DIFFERENT``."""
    pairs = [(False, "radix", "ours")] + [
        (True, impl, "ours KV+state (SGLang's rules)") for impl in args.impls if is_state_impl(impl)]
    out = []
    for w in args.workloads:
        for states, impl, label in pairs:
            ours = [r for a in ALLOCS for r in results.get(("ours", w, (states, a)), [])]
            theirs = results.get(("sglang", w, impl), [])
            if not (ours and theirs):
                continue
            cells, ok = [], True
            for f in SAME_WORK:
                a = {r[f] for r in ours if r.get(f) is not None}
                b = {r[f] for r in theirs if r.get(f) is not None}
                if not (a and b):
                    continue
                same = a == b and len(a) == 1
                ok &= same
                cells.append(f"{f} {_values(a)} {'=' if same else '!='} {_values(b)}")
            out.append(f"{w}: {label} vs SGLang {SHORT.get(impl, impl)}: " + ", ".join(cells)
                       + f" -> {'EQUAL' if ok else 'DIFFERENT'} (policy {args.policy}, page "
                       f"{args.page_size})")
    return out


def _values(vals: set[Any]) -> str:
    return "/".join(str(v) for v in sorted(vals))


# ------------------------------------------------------------------ memory
_MALLINFO = """
import ctypes
class _MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
_f = ctypes.CDLL("libc.so.6").mallinfo2
_f.restype = _MI
def malloc_used():
    m = _f()
    return m.uordblks + m.hblkhd
"""

ANCHOR_MEMORY_CHILD = _MALLINFO + """
import gc, importlib.util, json, sys, tracemalloc
method, script, *argv = sys.argv[1:]
spec = importlib.util.spec_from_file_location("sglang_radix_bench_anchor", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
captured = []
_orig = mod.build
def _build(args):
    r = _orig(args)
    captured.append(r)
    if method == "tracemalloc":
        tracemalloc.start()
    return r
mod.build = _build
ap_args = argv
sys.argv = [script] + ap_args
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    mod.main()
# A lazy import inside the anchor's build() keeps an exception traceback alive in some
# module, and with it build()'s and run()'s frames, which hold the cache: clear those frames
# (finished ones only) so dropping `captured` really drops the cache.
import types
for o in gc.get_objects():
    if isinstance(o, types.FrameType) and o.f_code.co_filename in (script, __file__):
        try:
            o.clear()
        except RuntimeError:
            pass
name, version, cache, api = captured[0]
if hasattr(cache, "full_evictable_size") and api.mamba:
    tokens = cache.full_evictable_size() + cache.full_protected_size()
else:
    tokens = cache.evictable_size() + cache.protected_size()
del name, version, cache, api
gc.collect()
m1 = tracemalloc.get_traced_memory()[0] if method == "tracemalloc" else malloc_used()
captured.clear()
gc.collect()
m2 = tracemalloc.get_traced_memory()[0] if method == "tracemalloc" else malloc_used()
print(json.dumps({"bytes": m1 - m2, "tokens": tokens}))
"""


def ours_memory_child(method: str, argv: list[str]) -> None:
    """Run in a child process: the workload, then the bytes released by dropping the cache."""
    import gc
    import tracemalloc

    from bench.dev.compare import radix_ops as radix_bench
    from bench.dev.compare.options import radix_ops_parser

    ns: dict[str, Any] = {}
    exec(_MALLINFO, ns)
    malloc_used = ns["malloc_used"]
    args = radix_ops_parser().parse_args(argv)
    keep: dict[str, Any] = {}
    if method == "tracemalloc":
        tracemalloc.start()
    radix_bench.run(args, keep)
    setup = keep.pop("setup")
    kv, states = setup.kv, setup.states  # the allocators outlive the cache: not counted
    tokens = setup.cache.total_size()
    nodes = setup.cache.tree.num_nodes
    gc.collect()
    m1 = tracemalloc.get_traced_memory()[0] if method == "tracemalloc" else malloc_used()
    del setup
    gc.collect()
    m2 = tracemalloc.get_traced_memory()[0] if method == "tracemalloc" else malloc_used()
    del kv, states
    print(json.dumps({"bytes": m1 - m2, "tokens": tokens, "nodes": nodes}))


def memory_table(args: argparse.Namespace, with_anchor: bool) -> tuple[str, list[dict]]:
    rows: list[dict] = []
    methods = ["malloc", "tracemalloc"]
    env = {"PYTHONMALLOC": "malloc"}
    child = None
    if with_anchor:
        fd, child = tempfile.mkstemp(suffix="_anchor_mem.py")
        with os.fdopen(fd, "w") as f:
            f.write(textwrap.dedent(ANCHOR_MEMORY_CHILD))
    try:
        for w in args.workloads:
            configs: list[tuple[str, Any]] = [("ours", False)]
            if args.states_too:
                configs.append(("ours", True))
            if with_anchor:
                configs += [("sglang", i) for i in args.memory_impls]
            for side, cfg in configs:
                row: dict[str, Any] = {"workload": w, "side": side, "config": cfg}
                for method in methods:
                    if side == "ours":
                        argv = ["--workload", w, "--allocator", "real", "--page-size",
                                str(args.page_size), "--policy", args.policy] + args.extra
                        if cfg:
                            argv.append("--states")
                        cmd = [sys.executable, "-m", "bench.dev.compare.sglang",
                               "--memory-child", method, "--"] + argv
                    else:
                        cmd = [args.anchor_python, child, method, str(args.anchor_script),
                               "--impl", cfg, "--workload", w, "--page-size",
                               str(args.page_size), "--policy", args.policy] + args.extra
                    r = _run(cmd, env=env)
                    row[method] = r["bytes"]
                    row["tokens"] = r["tokens"]
                rows.append(row)
                log(f"[memory] {w:9s} {side} {cfg}: {row}")
    finally:
        if child:
            os.unlink(child)

    def name(side: str, cfg: Any) -> str:
        if side == "ours":
            return "ours " + ("KV+state" if cfg else "KV")
        return f"SGLang {SHORT[cfg]}"

    lines = ["| workload | cache | tokens held | bytes/token (malloc: all) | "
             "bytes/token (tracemalloc: Python heap) |", "|---|---|---:|---:|---:|"]
    for r in rows:
        t = r["tokens"] or 1
        lines.append(f"| {r['workload']} | {name(r['side'], r['config'])} | {r['tokens']:,} | "
                     f"{r['malloc'] / t:.1f} | {r['tracemalloc'] / t:.1f} |")
    return "\n".join(lines), rows


# ------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = new_parser("compare", __doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3,
                    help="paired repetitions; ratios are medians over them (default 3)")
    ap.add_argument("--workloads", nargs="+", choices=["sysprompt", "multiturn"],
                    default=["sysprompt", "multiturn"],
                    help="the anchor's seeded workloads (default: both)")
    ap.add_argument("--impls", nargs="+", choices=ALL_IMPLS, default=DEFAULT_IMPLS,
                    help=f"SGLang caches to compare with (default: {' '.join(DEFAULT_IMPLS)})")
    ap.add_argument("--memory-impls", nargs="+", choices=ALL_IMPLS,
                    default=["radix", "unified-python", "unified-rust", "unified-mamba-rust"])
    ap.add_argument("--anchor-python", default=DEFAULT_ANCHOR_PYTHON)
    ap.add_argument("--anchor-script", default=DEFAULT_ANCHOR_SCRIPT,
                    help="the SGLang-side bench script (default $HPC_SGLANG_ANCHOR_SCRIPT)")
    ap.add_argument("--page-size", type=int, default=1, help="tokens per KV page (default 1)")
    ap.add_argument("--policy", default="lru", help="eviction policy on both sides (default lru)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="per-operation timers on both sides: this thread's CPU time (default; "
                         "robust on a shared machine) or wall time")
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    ap.add_argument("--json", metavar="FILE", type=output_path, help="write every run's JSON and the tables")
    ap.add_argument("--memory-child", choices=["malloc", "tracemalloc"], help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*",
                    help="after --: extra options passed to both benches (e.g. -- --requests 20000)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child:
        ours_memory_child(args.memory_child, args.extra)
        return 0
    args.states_too = any(is_state_impl(i) for i in args.impls)
    why = anchor_available(args)
    with_anchor = why is None
    if not with_anchor:
        print(f"NOTE: {why}", flush=True)
    t0 = time.perf_counter()
    results = run_reps(args, with_anchor)
    cmdline = "python -m bench compare " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n## {cmdline}\n")
    print(f"{args.reps} repetitions, interleaved; page size {args.page_size}, policy {args.policy}, "
          f"{args.clock} clock; load average at the start {os.getloadavg()[0]:.1f}")
    if with_anchor:
        for alloc in ALLOCS:
            desc = ("the anchor's convention: ids from a counter, free only counts"
                    if alloc == "counter" else "our real TokenAllocator/MambaStatePool")
            print(f"\n### ours / SGLang, median of paired ratios (ours with {alloc} allocator: {desc})\n")
            print(ratio_table(results, args, alloc))
    print("\n### ops/s, medians\n")
    print(rate_table(results, args))
    checks = hit_rate_check(results, args)
    if checks:
        print("\n### same work on both sides (KV only, and KV + state under SGLang's rules)\n")
        for c in checks:
            print("* " + c)
    mem_rows: list[dict] = []
    if args.memory:
        table, mem_rows = memory_table(args, with_anchor)
        print("\n### memory per cached token (bytes released when the cache is dropped / "
              "tokens it held)\n")
        print(table)
    print(f"\n(total {time.perf_counter() - t0:.0f}s)")
    if args.json:
        blob = {
            "command": cmdline,
            "runs": [{"side": k[0], "workload": k[1], "config": k[2], "results": v}
                     for k, v in results.items()],
            "memory": mem_rows,
        }
        Path(args.json).write_text(json.dumps(blob, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
