"""The lab's picture: each router's hit rate over time (10 s windows, the engines' own
cached tokens over prompt tokens), the available hit rate dashed, fault instants marked.
Run by the engines' interpreter (matplotlib is in the lab's install):
``python bench/lab/plot.py lab-<date>.json lab-<date>.png``."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BUCKET_S = 10.0


def series(records: list[dict], field: str) -> tuple[list[float], list[float]]:
    buckets: dict[int, list[float]] = {}
    for r in records:
        if r["ok"] and r["prompt_tokens"]:
            b = buckets.setdefault(int(r["at"] // BUCKET_S), [0.0, 0.0])
            b[0] += r[field]
            b[1] += r["prompt_tokens"]
    keys = sorted(buckets)
    return [(k + 0.5) * BUCKET_S for k in keys], [buckets[k][0] / buckets[k][1] for k in keys]


def main(source: str, target: str) -> None:
    with open(source) as f:
        data = json.load(f)
    fig, ax = plt.subplots(figsize=(10, 5))
    for run in data["routers"]:
        xs, ys = series(run["records"], "cached_tokens")
        (line,) = ax.plot(xs, ys, marker="o", label=run["router"])
        xs, ys = series(run["records"], "available_tokens")
        ax.plot(xs, ys, linestyle=":", color=line.get_color(), alpha=0.6)
    faults = data["routers"][0]["faults_at_s"] if data["routers"] else {}
    for name, at in faults.items():
        ax.axvline(at, color="grey", linestyle="--", linewidth=0.8)
        ax.text(at, 1.02, name, rotation=30, fontsize=8, transform=ax.get_xaxis_transform())
    if "engine_flapping" in faults:  # each kill of the flapping engine (the first router's)
        for at in data["routers"][0].get("kills_at_s", ())[1:]:
            ax.axvline(at, color="grey", linestyle=":", linewidth=0.8)
            ax.text(at, 1.02, "killed again", rotation=30, fontsize=8,
                    transform=ax.get_xaxis_transform())  # fmt: skip
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("prefix-cache hit rate (engines' own count)")
    ax.set_ylim(0, 1)
    ax.set_title("Hit rate per router (dotted: available, the best any router could do)", pad=40)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
