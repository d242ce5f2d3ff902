"""Training steps with glibc's default allocator settings against `keep_freed_memory`.

`training.device.keep_freed_memory` raises glibc's mmap threshold to its maximum and trims
only above 1 GB, so the large blocks of a training step (a batch's feature maps) are reused
instead of being returned to the kernel and faulted in again page by page. The setting is
process-wide and cannot be undone cleanly, so each measurement runs in a fresh process: per
network and round, one process with the defaults and one with the setting (order swapped every
round), each timing `--steps` SGD steps at batch 128 after 3 warm-up steps, one thread, and
reporting its wall, user and system seconds and minor page faults. Reports the medians and the
median of the paired wall-time ratios (setting / defaults: below 1 is faster):

    python -m bench.allocator               # lenet, lenet:64, resnet18; about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parse_networks, print_json, print_table  # noqa: E402

NETWORKS = ("lenet", "lenet:64", "resnet18")
CHILD = """
import json, resource, sys, time
import torch
from torch import nn
from models import build_model
from training.device import keep_freed_memory
name, width, steps, keep = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
applied = keep_freed_memory() if keep else False
torch.set_num_threads(1)
torch.manual_seed(0)
model = build_model(name, 1, 10, int(width) if width else None)
images, labels = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
def step():
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
for _ in range(3):
    step()
before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(steps):
    step()
wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": wall, "user": after.ru_utime - before.ru_utime,
                  "sys": after.ru_stime - before.ru_stime,
                  "page_faults": after.ru_minflt - before.ru_minflt, "applied": applied}))
"""


def child(network: str, steps: int, keep: bool) -> dict:
    name, _, width = network.partition(":")
    out = subprocess.run([sys.executable, "-c", CHILD, name, width, str(steps), str(int(keep))],
                         capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), metavar="MODEL[:WIDTH]")
    args = parser.parse_args()
    parse_networks(args.networks)  # an unknown model stops here, before any process starts
    figures, rows = {}, []
    for network in args.networks:
        runs = {"defaults": [], "keep_freed_memory": []}
        ratios = []
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            measured = {keep: child(network, args.steps, keep) for keep in order}
            runs["defaults"].append(measured[False])
            runs["keep_freed_memory"].append(measured[True])
            ratios.append(measured[True]["wall"] / measured[False]["wall"])
        figure = {setting: {key: statistics.median(r[key] for r in done) / args.steps
                            for key in ("wall", "user", "sys", "page_faults")}
                  for setting, done in runs.items()}
        figure["applied"] = all(r["applied"] for r in runs["keep_freed_memory"])
        figure["ratio"] = statistics.median(ratios)
        figures[network] = figure
        rows.append((network, *(f"{figure[s]['wall'] * 1000:.0f} / {figure[s]['sys'] * 1000:.0f}"
                                f" / {figure[s]['page_faults']:,.0f}" for s in runs),
                     f"{figure['ratio']:.2f}x"))
        print(f"{network}: {figure['ratio']:.2f}x", flush=True)
    print(f"\ncpu, 1 thread, batch 128, per step: wall ms / system ms / page faults (medians of "
          f"{args.rounds} processes each, {args.steps} steps each)")
    print_table(("network", "glibc defaults", "keep_freed_memory", "wall ratio"), rows)
    print_json({"benchmark": "allocator", "threads": 1, "batch": 128, "steps": args.steps,
                "rounds": args.rounds, "networks": figures})


if __name__ == "__main__":
    main()
