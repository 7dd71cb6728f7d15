"""Run every benchmarks/bench_*.py, each as its own process; fail if any fails (`make bench`).

    .venv/bin/python benchmarks/run_all.py                 # all of them, in name order
    .venv/bin/python benchmarks/run_all.py data pipeline   # only bench_data.py and bench_pipeline.py

Each benchmark writes benchmarks/results/<name>.json and <name>.md itself; this prints a
line per benchmark with its exit status and wall time, and exits 1 when one failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    benches = sorted(HERE.glob("bench_*.py"))
    if argv:
        wanted = {a.removeprefix("bench_").removesuffix(".py") for a in argv}
        unknown = wanted - {b.stem.removeprefix("bench_") for b in benches}
        if unknown:
            print(f"error: no benchmark named {', '.join(sorted(unknown))}; have "
                  f"{', '.join(b.stem.removeprefix('bench_') for b in benches)}", file=sys.stderr)
            return 2
        benches = [b for b in benches if b.stem.removeprefix("bench_") in wanted]
    failed = []
    for bench in benches:
        print(f"=== {bench.name}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(bench)], cwd=HERE.parent)
        print(f"=== {bench.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - start:.0f} s",
              flush=True)
        if rc != 0:
            failed.append(bench.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"all {len(benches)} benchmarks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
