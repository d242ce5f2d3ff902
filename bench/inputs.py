"""A served model's input preparation on PNG bytes: libpng straight into tensors against Pillow.

What `mlflow models serve` hands a registered model is a DataFrame of encoded images. This
benchmark times, in one process and one thread, turning Fashion-MNIST test images as PNG bytes
(`--rounds` calls a batch, walking through 512 images) into the normalized batch a served
network takes, two ways, alternating call by call (order swapped every round):

- `pillow`: every image decoded by Pillow into an image object, converted to an array
  (`training.preprocess.image_to_array`), stacked: the path every served model took before;
- `served`: what `serving.inputs.input_batches` does now: a plain PNG at the model's size
  decoded by libpng straight into a tensor (`training.preprocess.encoded_to_array`), stacked.

Per batch (1 and 64, the served batches): the medians in ms per image and the median of the
paired ratios (served / pillow: below 1 is faster), and whether both gave the same pixels
(they must: the test suite checks every PNG kind). Pure decoding, no model:

    python -m bench.inputs                  # 1 thread, about a minute
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_json, print_table  # noqa: E402
from bench.serving import png_frame, rows_of  # noqa: E402
from serving.inputs import input_batches, input_images  # noqa: E402
from training.batches import Normalize  # noqa: E402
from training.preprocess import images_to_batch  # noqa: E402

BATCHES = (1, 64)
SIZE, CHANNELS = 28, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400, help="calls per way and batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    frame = png_frame(64 * 8)
    normalize = Normalize((0.286,), (0.353,))  # Fashion-MNIST's, as a served model holds them
    ways = {
        "pillow": lambda rows: normalize(images_to_batch(input_images(rows), SIZE, CHANNELS)),
        "served": lambda rows: normalize(torch.cat(list(input_batches(rows, SIZE, CHANNELS)))),
    }
    figures = {}
    for batch in BATCHES:
        times: dict[str, list[float]] = {name: [] for name in ways}
        same = True
        for n in range(args.rounds + 1):
            rows = rows_of(frame, n, batch)
            order = list(ways) if n % 2 == 0 else list(ways)[::-1]
            out = {}
            for name in order:
                started = time.perf_counter()
                out[name] = ways[name](rows)
                if n:  # the first round warms both up
                    times[name].append((time.perf_counter() - started) / batch)
            same = same and torch.equal(out["pillow"], out["served"])
        ratios = [s / p for s, p in zip(times["served"], times["pillow"], strict=True)]
        figures[f"b{batch}"] = {f"{name}_ms_per_image": statistics.median(values) * 1e3
                                for name, values in times.items()} | {
            "ratio": statistics.median(ratios), "same_pixels": same}
    print_table(["batch", "pillow ms per image", "served ms per image", "served / pillow",
                 "same pixels"],
                [[batch.removeprefix("b"), f"{f['pillow_ms_per_image']:.4f}",
                  f"{f['served_ms_per_image']:.4f}", f"{f['ratio']:.2f}x", str(f["same_pixels"])]
                 for batch, f in figures.items()])
    print_json({"benchmark": "inputs", "rounds": args.rounds, "threads": 1,
                "device": f"{platform.machine()} CPU", "images": f"Fashion-MNIST test, PNG, "
                f"{SIZE} px gray", "batches": figures})


if __name__ == "__main__":
    main()
