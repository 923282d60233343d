"""after / before per interleaved pair and their medians, from pairs.sh's output:
python ratios.py pairs.txt"""

import json
import statistics
import sys

runs: dict[str, dict] = {}
for line in open(sys.argv[1]):
    if line.strip():
        tree, pair, figures = line.split(" ", 2)
        runs.setdefault(pair, {})[tree] = json.loads(figures)
pairs = [r for r in runs.values() if len(r) == 2]
for fmt in ("bf16", "w8a8", "w4a16"):
    wall = [r["after"][fmt][0] / r["before"][fmt][0] for r in pairs]
    cpu = [r["before"][fmt][1] / r["after"][fmt][1] for r in pairs]
    print(
        f"{fmt}: after / before tokens/s (wall) {[round(x, 2) for x in wall]} median "
        f"{statistics.median(wall):.2f}; by CPU time {[round(x, 2) for x in cpu]} median "
        f"{statistics.median(cpu):.2f}"
    )
