"""The `cascade` flow's tasks: `tasks` (difficulty sets, the latency table, module rounds,
predictors, the exit heads' refit) and `evaluation` (calibration, test and registration)."""
