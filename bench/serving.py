"""Registered models as a client meets them: `predict` on raw PNG bytes, side by side.

Each registered pyfunc (by default the `train` flow's champion, the baseline, and the
`pipeline` flow's, what `make run` registers) is loaded as `mlflow models serve` loads it and
called on a DataFrame of PNG bytes of Fashion-MNIST test images (the column `image`, as the
scoring server hands a request to the model), one thread, the models' calls interleaved:

- client: milliseconds per image of `predict` at batch 1 and at batch 64 (medians over the
  calls), and the ratio to the baseline's at the same batch;
- network: the same per image for the model's networks alone in the process (the program's
  forward, or the fallback cascade's student and teacher on the same prepared batch), and
  client / network, what the serving path around the network costs;
- input: milliseconds per image of turning the PNGs into the model's normalized batch
  (`serving.inputs.input_batches`: decode, convert, stack, normalize), the part of the
  client's time that is neither the network nor MLflow's call.

    python -m bench.serving                          # the two champions, about a minute
    python -m bench.serving --models models:/compactml-train/1 models:/compactml-pipeline/1
    python -m bench.serving --export-checks          # and each with torch.export's input checks

It reads no accuracy: what a model gets right is in `bench.pipeline` and the flows' tables.
"""

from __future__ import annotations

import argparse
import io
import platform
import statistics
import time
from collections.abc import Callable

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from PIL import Image

from bench.common import EXPORT_CHECKS, print_json, print_table
from serving.classifier import for_serving
from serving.fallback import logits_of
from serving.inputs import input_batches
from tasks.adapters import tracking
from tasks.adapters.registration import served_parameters
from tasks.configs.sections import model_name_of
from tasks.data import fashion_mnist_root
from training.cascade.fallback import fallback_infer
from training.datasets import load_fashion_mnist

BATCHES = (1, 64)
CALLS = {1: 300, 64: 20}  # calls per model and batch (after one warm-up call)


def png_bytes(images: np.ndarray) -> pd.DataFrame:
    """Raw uint8 images (N x H x W) as a DataFrame of PNG bytes in the column `image`, what
    the scoring server hands the model."""
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return pd.DataFrame({"image": encoded})


def png_frame(count: int) -> pd.DataFrame:
    """The first `count` Fashion-MNIST test images as a DataFrame of PNG bytes."""
    test = load_fashion_mnist(fashion_mnist_root(), train=False)
    return png_bytes(test.images[:count, 0].numpy())


def rows_of(frame: pd.DataFrame, n: int, batch: int) -> pd.DataFrame:
    """The `n`-th call's `batch` images (the calls walk through the frame)."""
    start = (n * batch) % (len(frame) - batch + 1)
    return frame.iloc[start:start + batch].reset_index(drop=True)


def requests_of(frame: pd.DataFrame, batch: int) -> list[pd.DataFrame]:
    """The DataFrame of each call at `batch` images a call (the warm-up's first), cut before
    any timing starts: the scoring server hands `predict` a DataFrame it has built, so
    building one is not the model's time."""
    return [rows_of(frame, n, batch) for n in range(CALLS[batch] + 1)]


def interleaved(calls: dict[str, Callable[[int], object]], count: int) -> dict[str, float]:
    """Median seconds of each call (given the call's number), the calls interleaved, after
    one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for n in range(count + 1):
        for name, call in calls.items():
            started = time.perf_counter()
            call(n)
            if n:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def client_ms(models: dict[str, object], frame: pd.DataFrame) -> dict[str, dict[int, float]]:
    """Each loaded pyfunc's median milliseconds per image of `predict` on the frame's PNG
    bytes, at each of `BATCHES` images a call (`requests_of`), the models' calls
    interleaved."""
    figures: dict[str, dict[int, float]] = {name: {} for name in models}
    for batch in BATCHES:
        requests = requests_of(frame, batch)
        client = interleaved({name: (lambda n, m=model, r=requests: m.predict(r[n]))
                              for name, model in models.items()}, CALLS[batch])
        for name in models:
            figures[name][batch] = client[name] * 1e3 / batch
    return figures


def network_call(implementation) -> Callable[[torch.Tensor], object]:
    """The model's networks alone on a prepared (normalized) batch: its program, or the
    fallback cascade's student and, for the images it passes on, the teacher."""
    if hasattr(implementation, "teacher"):
        return lambda x: fallback_infer(implementation.student, implementation.teacher, x,
                                        implementation.threshold, implementation.router)
    return implementation.program


def with_export_checks(model):  # noqa: ANN001, ANN201 (a loaded pyfunc)
    """`model` (a loaded pyfunc of the classifier or fallback kind) with its programs as
    `torch.export` loads them, checking every call's input, as served models ran them before
    `serving.classifier.load_program` dropped the checks: `--export-checks`' other arm."""
    implementation = model.unwrap_python_model().implementation
    artifacts = model._model_impl.context.artifacts  # the load's context: MLflow keeps it there
    implementation.program = for_serving(torch.export.load(artifacts["program"]).module())
    if hasattr(implementation, "teacher"):
        implementation.fallback = for_serving(torch.export.load(artifacts["fallback"]).module())
        implementation.student = logits_of(implementation.program)
        implementation.teacher = logits_of(implementation.fallback)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[
        f"models:/{model_name_of(None, None, 'train')}@champion",
        f"models:/{model_name_of(None, None, 'pipeline')}@champion"],
        help="registered model URIs; the first is the baseline of the ratios")
    parser.add_argument("--export-checks", action="store_true", help="also each model with "
                        "torch.export's per-call input checks on (as served before they were "
                        "dropped), timed beside it: what dropping them buys")
    args = parser.parse_args()
    torch.set_num_threads(1)
    frame = png_frame(max(CALLS[1], 64 * 4))
    loaded = {}
    for uri in args.models:
        name, _, alias = uri.removeprefix("models:/").partition("@")
        if alias:  # the version the alias points at now, for the record
            version = tracking.alias_version(name, alias)
            if version is None:
                raise SystemExit(f"error: {uri} does not exist: run `make run` (pipeline) and "
                                 "`python -m flows train --profile quick` (train) first, or "
                                 "give --models")
            uri = f"models:/{name}/{version}"
        loaded[uri] = tracking.load_pyfunc(uri)
        if args.export_checks:
            # its own copy (load_pyfunc hands one object per URI to a process)
            loaded[uri + EXPORT_CHECKS] = with_export_checks(mlflow.pyfunc.load_model(uri))
    resolved = {uri: model.unwrap_python_model().implementation for uri, model in loaded.items()}
    figures: dict[str, dict] = {
        uri: {"parameters": served_parameters(uri.removesuffix(EXPORT_CHECKS))} for uri in loaded}
    client = client_ms(loaded, frame)
    for batch in BATCHES:
        prepared = {uri: [impl.normalize(torch.cat(list(input_batches(
            request, impl.size, impl.channels)))) for request in requests_of(frame, batch)]
            for uri, impl in resolved.items()}
        forwards = {uri: network_call(impl) for uri, impl in resolved.items()}
        with torch.no_grad():
            network = interleaved({uri: (lambda n, f=forwards[uri], x=prepared[uri]: f(x[n]))
                                   for uri in resolved}, CALLS[batch])
        for uri in loaded:
            figures[uri] |= {f"client_ms_b{batch}": client[uri][batch],
                             f"network_ms_b{batch}": network[uri] * 1e3 / batch}
    baseline = next(iter(loaded))
    for figure in figures.values():
        for batch in BATCHES:
            figure[f"client_over_network_b{batch}"] = (figure[f"client_ms_b{batch}"]
                                                       / figure[f"network_ms_b{batch}"])
            figure[f"client_vs_baseline_b{batch}"] = (figure[f"client_ms_b{batch}"]
                                                      / figures[baseline][f"client_ms_b{batch}"])
    for batch in BATCHES:
        requests = requests_of(frame, batch)
        inputs = interleaved({uri: (lambda n, i=impl, r=requests: i.normalize(torch.cat(list(
            input_batches(r[n], i.size, i.channels)))))
            for uri, impl in resolved.items()}, CALLS[batch])
        for uri in loaded:
            figures[uri][f"input_ms_b{batch}"] = inputs[uri] * 1e3 / batch
    print_table(["model", "parameters", "client ms b1", "b64", "network ms b1", "b64",
                 "client/network b1", "b64", "vs baseline b1", "b64"],
                [[uri, f"{f['parameters']:,}", *(f"{f[k]:.3f}" for k in (
                    "client_ms_b1", "client_ms_b64", "network_ms_b1", "network_ms_b64")),
                  *(f"{f[k]:.2f}x" for k in ("client_over_network_b1", "client_over_network_b64",
                                             "client_vs_baseline_b1", "client_vs_baseline_b64"))]
                 for uri, f in figures.items()])
    print("\ninput (decode to normalized batch), ms per image: " + ", ".join(
        f"{uri} {f['input_ms_b1']:.3f} at b1, {f['input_ms_b64']:.3f} at b64"
        for uri, f in figures.items()))
    print_json({"benchmark": "serving", "models": figures, "baseline": baseline,
                "threads": 1, "calls": {str(k): v for k, v in CALLS.items()},
                "device": f"{platform.machine()} CPU, {torch.get_num_threads()} thread"})


if __name__ == "__main__":
    main()
