"""What the tasks use to reach the outside: MLflow tracking (`tracking`), the registry's
registration and aliases (`registration`, `aliases`), DVC versioning and the artifact store
(`versioning`, `checkpoints`), Prefect caching and task runners (`caching`, `runners`), the
torchrun launcher (`torchrun`), the project's environment (`environment`), run summaries
(`reporting`) and the WordNet reader (`wordnet`). No Prefect task is defined here but
`register-and-promote`."""
