"""Activation sparsity, pure PyTorch: the transforms, per-layer lambdas and the regularized step
(`term`), calibrated activation thresholds (`thresholds`) and dead-channel pruning
(`pruning`)."""
