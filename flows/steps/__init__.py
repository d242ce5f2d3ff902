"""Each technique's step: the one function (with what only it needs) that both the technique's
own flow (`flows/<technique>.py`) and the `pipeline` call, so a flow module composes the others
through this package and `flows.skeleton` alone, never through a sibling flow. A step module
lists in `__all__` what others may import (tests/test_layering.py)."""
