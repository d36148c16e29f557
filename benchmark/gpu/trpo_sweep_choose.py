"""How many runs (P and R in pairs) call 2 starts: the most whose estimated time, from the probe at 16 runs at once
(an upper bound for fewer), fits before the deadline. Estimate: first update + 66 steady updates + the evaluation's
10,000 single-env steps (~6.7 rollouts) + 30 s (conversion done, saves), times 1.1."""

import json
import os
import sys
import tempfile
import time

t0, wall = float(sys.argv[1]), float(sys.argv[2])
left = t0 + wall - time.time() - 30  # packing and margin
probes = json.load(open(os.path.join(tempfile.gettempdir(), "probe.json")))
if "16" not in probes:
    print(0)
    sys.exit()
p = probes["16"]
est = 1.1 * (p["first"] + 66 * p["steady"] + 6.7 * p["rollout"] + 30)
print(f"left {left:.0f} s, estimated run at 16 at once {est:.0f} s", file=sys.stderr)
print(16 if est < left else 12 if est * 0.85 < left else 8 if est * 0.7 < left else 4 if est * 0.55 < left else 0)
