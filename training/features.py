"""Features from named layers through forward hooks, so networks stay unchanged (torchdistill)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn


class FeatureHooks:
    """Captures the outputs of named sub-modules during a forward pass.

    Use as a context manager: `with FeatureHooks(model, ["stage3"]) as feats: model(x)`, then
    `feats["stage3"]` holds that layer's output of the last forward pass. Hooks are removed on
    exit. An unknown layer name raises `KeyError` naming the valid ones.
    """

    def __init__(self, model: nn.Module, layers: Sequence[str], detach: bool = False) -> None:
        names = dict(model.named_modules())
        missing = [name for name in layers if name not in names]
        if missing:
            valid = getattr(model, "feature_layers", ()) or tuple(n for n in names if n)
            raise KeyError(f"no layer {missing} in {type(model).__name__}; try one of {valid}")
        self.detach = detach
        self.outputs: dict[str, Tensor] = {}
        self._handles = [names[name].register_forward_hook(self._hook(name)) for name in layers]

    def _hook(self, name: str):
        def hook(_module: nn.Module, _inputs: tuple, output: Tensor) -> None:
            self.outputs[name] = output.detach() if self.detach else output

        return hook

    def __getitem__(self, name: str) -> Tensor:
        return self.outputs[name]

    def remove(self) -> None:
        """Detaches every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> FeatureHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
