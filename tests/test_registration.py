"""The promotion rule: champion only when strictly better (ties keep the current champion)."""

from tasks.adapters.registration import CHALLENGER, CHAMPION, decide, pip_requirements


def test_promotion_rule():
    assert decide(0.80, None) == (CHAMPION, "no champion yet")
    assert decide(0.81, 0.80)[0] == CHAMPION
    assert decide(0.80, 0.80)[0] == CHALLENGER
    alias, reason = decide(0.79, 0.80)
    assert alias == CHALLENGER and "0.7900 <= 0.8000" in reason


def test_served_model_pins_what_it_imports():
    pins = dict(line.split("==") for line in pip_requirements())
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    assert set(pins) == {"torch", "torchvision", "mlflow", "pillow", "pandas", "numpy"}
