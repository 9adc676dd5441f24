"""The training run: recurrence sampling, the cost model, optimizers, parallelism, the trainer."""
