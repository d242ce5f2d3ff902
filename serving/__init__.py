"""The runtime every registered model ships: MLflow pyfuncs that take raw images.

A registered model carries `serving/`, `models/` and `training/` as its code and nothing else:
serving never imports Prefect, DVC or `tasks/` (`tests/test_layering.py` checks it), so a
model loads wherever MLflow and PyTorch do. One models-from-code entry
(`serving/pyfunc_model.py`) builds the kind of model its `model_config` names
(`serving.entry.KINDS`): `classifier`, `cascade`, `canvas` (detection, contour), `fallback`
(the pipeline's two networks) or `image_text`.
"""
