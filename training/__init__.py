"""How networks learn, in pure PyTorch: data, batches, loops, losses, features.

Nothing here imports Prefect, MLflow or DVC (a test enforces it).
"""
