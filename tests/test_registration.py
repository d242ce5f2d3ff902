"""What a registered model pins (the promotion rule itself: tests/test_promotion.py)."""

from tasks.adapters.registration import pip_requirements


def test_served_model_pins_what_it_imports():
    pins = dict(line.split("==") for line in pip_requirements())
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    assert set(pins) == {"torch", "torchvision", "mlflow", "pillow", "pandas", "numpy"}
