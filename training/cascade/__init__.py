"""Cascaded early exits, pure PyTorch: difficulty, curriculum, module and predictor steps, exit
tables and threshold calibration (`learning`), and the two-network fallback the pipeline
serves (`fallback`) with its routing, the exit rule or a fitted predictor (`routing`)."""
