"""Activation sparsity, pure PyTorch: the transforms, per-layer lambdas and the regularized step
(`term`), calibrated activation thresholds (`thresholds`), dead-channel pruning (`pruning`)
and what a trained network's activations look like on a split (`report`)."""
