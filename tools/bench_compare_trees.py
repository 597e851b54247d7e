"""Run one benchmark script in two checkouts, interleaved, and compare their JSON; prints JSON.

    python tools/bench_compare_trees.py --base /path/to/old-checkout --new . \\
        --runs 3 [--timeout-s 900] -- tools/bench_daemon.py --rounds 2

For a change that must be "no worse beyond run-to-run noise" (a re-cut, say), against the
commit before it: each checkout runs the benchmark with its own `.venv/bin/python`, in turn
(base, new, new, base, base, new, ... so that neither always goes first), on this machine in
this session, so background load falls on both alike. Each run's JSON (the script's stdout) is
flattened to `path.to.number` leaves. Reported per leaf: the median of each side, new / base,
and the noise: the spread (max / min) of the base side's own runs. A leaf is "beyond noise" when
new / base falls outside that spread widened to the new side's own, in the worse direction (the
caller says which leaves are better high with --higher-is-better; the rest are compared both
ways and only flagged).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any


def flatten(value: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a JSON value, keyed by their dotted path (booleans left out)."""
    leaves: dict[str, float] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            leaves.update(flatten(item, f"{prefix}{key}."))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            leaves.update(flatten(item, f"{prefix}{index}."))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        leaves[prefix.rstrip(".")] = float(value)
    return leaves


def run_once(tree: str, script_args: list[str], timeout_s: float) -> dict[str, Any]:
    python = os.path.join(tree, ".venv", "bin", "python")
    if not os.access(python, os.X_OK):
        raise SystemExit(f"{python} is missing: run `bash scripts/setup-venv.sh` in {tree} first")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # each tree imports its own package, from its own venv
    started = time.perf_counter()
    done = subprocess.run([python, *script_args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(script_args)} failed in {tree} (exit {done.returncode}):\n"
                         f"{done.stderr[-4000:]}")
    report = json.loads(done.stdout)
    report["_wall_s"] = round(time.perf_counter() - started, 2)
    return report


def order_of_runs(num_runs: int) -> list[str]:
    """base, new, new, base, base, new, ...: each side goes first equally often."""
    order: list[str] = []
    for index in range(num_runs):
        order += ["base", "new"] if index % 2 == 0 else ["new", "base"]
    return order


def compare(base_runs: list[dict[str, float]], new_runs: list[dict[str, float]],
            higher_is_better: list[str], lower_is_better: list[str]) -> dict[str, Any]:
    common = sorted(set.intersection(*(set(r) for r in base_runs + new_runs)))
    rows: dict[str, Any] = {}
    for key in common:
        base = [r[key] for r in base_runs]
        new = [r[key] for r in new_runs]
        base_med, new_med = statistics.median(base), statistics.median(new)
        if base_med == 0 or min(base + new) <= 0:
            continue
        ratio = new_med / base_med
        # The noise: how far apart one side's own runs land, the wider of the two sides.
        spread = max(max(base) / min(base), max(new) / min(new))
        direction = ("higher" if any(key.endswith(s) for s in higher_is_better)
                     else "lower" if any(key.endswith(s) for s in lower_is_better) else "")
        worse = ((direction == "higher" and ratio < 1 / spread)
                 or (direction == "lower" and ratio > spread))
        rows[key] = {"base_median": round(base_med, 6), "new_median": round(new_med, 6),
                     "new_over_base": round(ratio, 3), "run_spread": round(spread, 3),
                     "better": direction or "either", "worse_beyond_noise": worse}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the checkout before the change")
    parser.add_argument("--new", required=True, help="the checkout with the change")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--higher-is-better", action="append", default=[],
                        help="a leaf-name suffix whose larger value is better (repeatable)")
    parser.add_argument("--lower-is-better", action="append", default=[],
                        help="a leaf-name suffix whose smaller value is better (repeatable)")
    parser.add_argument("--keep", action="append", default=[],
                        help="report only leaves that contain this text (repeatable)")
    parser.add_argument("script", nargs=argparse.REMAINDER,
                        help="-- then the benchmark script and its arguments, relative to a tree")
    args = parser.parse_args(argv)
    script = [a for a in args.script if a != "--"] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the benchmark script after --")
    if args.runs < 2:
        parser.error("--runs must be at least 2: one run per side shows no noise")
    trees = {"base": os.path.abspath(args.base), "new": os.path.abspath(args.new)}
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    walls: dict[str, list[float]] = {"base": [], "new": []}
    for number, side in enumerate(order_of_runs(args.runs), 1):
        print(f"[{number}/{2 * args.runs}] {side}: {' '.join(script)}", file=sys.stderr, flush=True)
        report = run_once(trees[side], script, args.timeout_s)
        walls[side].append(report.pop("_wall_s"))
        leaves = flatten(report)
        if args.keep:
            leaves = {k: v for k, v in leaves.items() if any(text in k for text in args.keep)}
        runs[side].append(leaves)
    rows = compare(runs["base"], runs["new"], args.higher_is_better, args.lower_is_better)
    print(json.dumps({
        "script": script, "trees": trees, "runs_per_side": args.runs,
        "order": order_of_runs(args.runs), "wall_s": walls,
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "worse_beyond_noise": sorted(k for k, row in rows.items() if row["worse_beyond_noise"]),
        "leaves": rows,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
