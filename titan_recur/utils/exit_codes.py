"""Every exit code of titan_recur's commands, in one place (docs/checkpointing.md lists them): the trainer,
its watchdog, the check, and the offline commands all exit with these, and Slurm scripts branch on them."""

# The command did what it was asked.
EXIT_OK = 0
# An I/O failure (disk full, a failed upload) while running; whatever was written before is intact.
EXIT_IO_FAILURE = 1
# Bad input: a flag, config, data, model or checkpoint that cannot be used. Nothing was written.
EXIT_BAD_INPUT = 2
# Training stopped on a non-finite (or spiking) loss or grad norm (the last checkpoint is the last good state).
EXIT_NONFINITE = 3
# A step did not finish in time (training.step_timeout_s) or a collective timed out / lost a rank.
EXIT_STALLED = 4
# After SIGTERM/SIGUSR1 with the checkpoint written: Slurm scripts requeue on it (slurm/launch.sh).
EXIT_PREEMPTED = 42
# A second Ctrl-C (or one before training): stopped at once, nothing of the step saved (128 + SIGINT, as shells).
EXIT_INTERRUPTED = 130
