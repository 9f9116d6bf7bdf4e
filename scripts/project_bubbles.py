"""Projection of the bubble reduction to 64 to 256 ranks, from two measured parts: the balancer's replay simulation
and the embedding bench. A model, not a measurement:

    bubbles(mode, N) = straggler wait at N ranks (replay: straggler % x mean step time, jagged kernel)
                       + exposed embedding communication per step (bench embedding, 2 ranks)

sync pairs the unbalanced replay with the synchronous path's exposed time; freescale pairs the FBS replay
with the prioritized path's. The embedding exposure is held at its 2-rank value, which flatters sync's side
least: an AllToAll over N ranks only gets slower.

    python3 scripts/project_bubbles.py docs/bench/replay_h200_jagged.json docs/bench/embedding_2xh200.json
"""

from __future__ import annotations

import json
import sys


def main(replay_path: str, embedding_path: str, collision: float = 0.05, jitter: str = "repeat") -> None:
    replay = json.load(open(replay_path))
    emb = json.load(open(embedding_path))
    point = min(
        (r for r in emb["records"] if r["max_uih"] == max(x["max_uih"] for x in emb["records"])),
        key=lambda r: abs(r["collision_knob"] - collision),
    )
    e_sync, e_prio = point["sync_exposed_ms"]["total"], point["prioritized_exposed_ms"]["total"]
    print(
        f"exposed embedding communication per step (2 ranks, {point['collision_measured']:.3f} collisions): "
        f"sync {e_sync:.2f} ms, prioritized {e_prio:.2f} ms"
    )
    print(
        f"{'ranks':>5} {'wait none ms':>12} {'wait fbs ms':>11} {'bubbles sync':>12} {'bubbles freescale':>17} "
        f"{'reduction':>9}"
    )
    replay = [r for r in replay if "error" not in r and "ranks" in r]  # a failed fit leaves a record without figures
    ranks = sorted({r["ranks"] for r in replay if r.get("replay_kernel") == "jagged"})
    for n in ranks:
        rec = {
            r["partitioner"]: r
            for r in replay
            if r.get("replay_kernel") == "jagged" and r.get("jitter") == jitter and r["ranks"] == n
        }
        if not {"none", "fbs"} <= set(rec):
            raise SystemExit(f"{replay_path}: {n} ranks lacks the none or fbs record (run replay with both)")
        wait = {p: rec[p]["straggler_pct"] / 100 * rec[p]["mean_step_s"] * 1e3 for p in ("none", "fbs")}
        sync, fs = wait["none"] + e_sync, wait["fbs"] + e_prio
        print(
            f"{n:>5} {wait['none']:>12.1f} {wait['fbs']:>11.1f} {sync:>12.1f} {fs:>17.1f} "
            f"{100 * (1 - fs / sync):>8.1f}%"
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
