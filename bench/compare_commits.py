"""Two commits side by side in one run: each benchmark script runs on the
base commit and on the working tree in turn, rounds alternating so that the
machine's noise hits both alike, and every timed cell of the scripts' tables
is compared (medians over the rounds, head / base).

    python bench/compare_commits.py --base REV [--scripts op_latency train_step "adaptive --repeats 3"]
                                    [--rounds 3] [--write docs/benchmarks.md]

The base runs from a git worktree of REV with the working tree's built C++
glue (torchneuron._C) copied in, so only the Python differs: REV and the
working tree must have the same csrc/.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from report import command_line, publish  # noqa: E402

_TIME = re.compile(r"^([0-9.]+) (µs|ms|s)$")
_UNIT = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}


def _git(*args) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def base_tree(rev: str) -> str:
    """A worktree of rev with the working tree's built glue; the caller removes it."""
    if subprocess.run(["git", "-C", ROOT, "diff", "--quiet", rev, "--", "csrc", "setup.py"]).returncode != 0:
        raise SystemExit(f"compare_commits: {rev} has another csrc/: build it on its own instead")
    where = tempfile.mkdtemp(prefix="tn-base-")
    _git("worktree", "add", "--detach", where, rev)
    for built in glob.glob(os.path.join(ROOT, "src", "torchneuron", "_C*.so")):
        shutil.copy2(built, os.path.join(where, "src", "torchneuron"))
    return where


def run(tree: str, script: str) -> str:
    """The printed report of a script ("name [its options]"), run with
    `tree`'s torchneuron first on the path."""
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "src"))
    env.pop("TORCHNEURON_CACHE_DIR", None)  # each run cold, in a cache of its own
    name, *options = shlex.split(script)
    done = subprocess.run([sys.executable, os.path.join(tree, "bench", f"{name}.py"), *options], env=env, cwd=tree,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compare_commits: {script} failed in {tree}:\n{done.stderr[-3000:]}")
    return done.stdout


def timed_cells(report: str) -> dict:
    """{(row, column): seconds} of every table cell holding a time."""
    cells = {}
    header = None
    for line in report.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = row
            continue
        for column, cell in zip(header[1:], row[1:]):
            found = _TIME.match(cell)
            if found:
                cells[(row[0] or "step", column)] = float(found.group(1)) * _UNIT[found.group(2)]
    return cells


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--scripts", nargs="+", default=["op_latency", "train_step"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", help="update this markdown file's compare_commits section")
    args = parser.parse_args()
    base = base_tree(args.base)
    samples = collections.defaultdict(lambda: {"base": [], "head": []})
    machine = ""
    try:
        for _ in range(args.rounds):
            for script in args.scripts:
                for side, tree in (("base", base), ("head", ROOT)):
                    report = run(tree, script)
                    machine = machine or next((x for x in report.splitlines() if x.startswith("Machine:")), "")
                    for cell, seconds in timed_cells(report).items():
                        samples[(script, *cell)][side].append(seconds)
    finally:
        _git("worktree", "remove", "--force", base)
    head = _git("rev-parse", "--short", "HEAD")
    lines = [
        "## Two commits side by side",
        "",
        f"Command: `{command_line()}` (working tree at {head}"
        f"{' with changes' if _git('status', '--porcelain', '--untracked-files=no') else ''})  ",
        machine,
        f"Each script ran {args.rounds} times on each side, the sides alternating; medians over the runs.",
        "",
        "| script | row | column | base | head | head / base |",
        "|---|---|---|---:|---:|---:|",
    ]
    for (script, row, column), sides in samples.items():
        if len(sides["base"]) == len(sides["head"]) == args.rounds:
            b, h = statistics.median(sides["base"]), statistics.median(sides["head"])
            lines.append(f"| {script} | {row} | {column} | {_fmt(b)} | {_fmt(h)} | {h / b:.2f}x |")
    publish(lines, args.write, "compare_commits")


if __name__ == "__main__":
    main()
