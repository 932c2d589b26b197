"""The exit statuses of the ``spmd-*`` commands (README, "Exit statuses"): schedulers requeue on
``EXIT_PREEMPTED`` and on the coordinator's 75. Their own module so every command imports them
without importing another command."""

EXIT_OK = 0  # the run finished (or --print-config / a dry run that fits)
EXIT_INTERNAL = 1  # an unexpected error: a bug; rerun with --debug for the traceback
EXIT_USAGE = 2  # a user error: bad flag, config, mesh, data path, checkpoint mismatch (the message names it)
EXIT_DIVERGED = 3  # run.guard stopped the run: loss or grad norm not finite or spiking, or a destructive update
EXIT_COORDINATOR = 75  # peers or the coordinator never came (meshes.distributed.INIT_TIMEOUT_EXIT_CODE)
EXIT_PREEMPTED = 76  # stopped by SIGTERM / SIGINT after saving a checkpoint: run the same command to resume
EXIT_INTERRUPTED = 130  # Ctrl-C before there was anything to save
