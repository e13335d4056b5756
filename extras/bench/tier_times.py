"""The README's two tiers of tests, timed as a newcomer runs them: on a fresh clone of HEAD, the fast
tier (`python -m pytest`), then the slow tier (`python -m pytest -m slow`), each as a whole command.

    python -m extras.bench.tier_times             # -> docs/test_times.json, then: python -m extras.bench.pages

Run it alone on the machine (the tiers use every core); the README's installs must be done.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from extras.bench.course_search import machine

TIERS = {"fast": "python -m pytest", "slow": "python -m pytest -m slow"}


def timed(command, cwd):
    """Seconds and the counts of pytest's last line ("3 failed, 120 passed, ... in 80.1s")."""
    t0 = time.time()
    proc = subprocess.run(command.replace("python", sys.executable, 1).split() + ["-q"], cwd=cwd,
                          capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last)}
    print(f"{command}: {last}", flush=True)
    return {"command": command, "seconds": round(time.time() - t0, 1), "passed": counts.get("passed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
            "skipped": counts.get("skipped", 0)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/test_times.json", help="where the times go (default %(default)s)")
    p.add_argument("--tier", choices=list(TIERS), default=None, help="time this tier alone, keeping the other's record in --out "
                                                        "(default both)")
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as clone:
        subprocess.run(["git", "clone", "-q", ".", clone], check=True)
        tiers = {name: {**timed(TIERS[name], clone), "commit": commit} for name in ([args.tier] if args.tier else TIERS)}
    kept = json.load(open(args.out))["tiers"] if args.tier and os.path.exists(args.out) else {}
    result = {"what": "the README's two tiers of tests, each timed as a whole command on a fresh clone of its "
                      "commit, after the README's installs",
              "command": "python -m extras.bench.tier_times", "machine": machine(), "tiers": {**kept, **tiers}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
