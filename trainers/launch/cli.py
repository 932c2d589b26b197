"""``spmd-train TARGET [--tiny] [--set key=value ...]``: the command every host of a pod runs.

TARGET is a recipe (``gpt-small``, ``gpt-125m``, ...) or ``package.module:attribute`` naming a
:class:`trainers.task.Task`.

    spmd-train gpt-small --simulate-devices 8
    spmd-train trainers.examples.digits:task --simulate-devices 8

See docs/many-hosts.md.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import traceback
from importlib import metadata

from trainers.launch.exits import (  # noqa: F401
    EXIT_COORDINATOR,
    EXIT_DIVERGED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
)

# The recipes' names, for --help without importing jax (tests check it equals trainers.recipes.RECIPES).
RECIPE_NAMES = ("gpt-small", "gpt-small-pp", "gpt-125m", "gpt-350m", "gpt-moe")

EXAMPLES = """examples:
  spmd-train gpt-small --simulate-devices 8                  the main job on 8 simulated CPU devices
  spmd-train gpt-small --tiny --simulate-devices 8           a 2-step smoke run
  spmd-train gpt-125m --mesh fsdp=-1 --set lr.peak_lr=1e-3   on the real devices, FSDP over all of them
  spmd-train trainers.examples.digits:task --simulate-devices 8
  spmd-train gpt-350m --dry-run --devices 64 --hardware tpu-v5p   compile only: memory, collectives, time
  spmd-train gpt-small --print-config > run.json              every config key, as a file --config reads

exit statuses: 0 finished, 1 internal error (rerun with --debug), 2 user error (the message names
the flag or config key), 3 diverged (run.guard stopped it), 75 peers or coordinator never came,
76 preempted after saving a checkpoint (run the same command to resume), 130 interrupted by Ctrl-C.
"""


def _version() -> str:
    def v(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return f"spmd {v('spmd')} (jax {v('jax')}, jaxlib {v('jaxlib')}, flax {v('flax')}, orbax-checkpoint " \
           f"{v('orbax-checkpoint')}, python {sys.version.split()[0]})"


def _count(least: int):
    """An argparse type: an integer >= ``least``, else a message naming the value and what is valid."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: give an integer >= {least}")
        return value
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spmd-train", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Train a recipe or a task on this host's (or every host's) devices.")
    p.add_argument("target", metavar="TARGET",
                   help=f"a recipe ({', '.join(RECIPE_NAMES)}) or a task as package.module:attribute")
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("--config", metavar="FILE",
                   help="a YAML or JSON config file: the keys of --set, nested or dotted (--set and flags override it)")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-step smoke run (a recipe's tiny variant also shrinks its model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.d_model=256 (repeatable)")
    p.add_argument("--mesh", help="mesh axis sizes, e.g. data=2,tensor=4 (-1 infers one axis), or auto: the planner "
                                  "picks mesh, rule set and remat policy (those not fixed by --rules / --set model.remat*)")
    p.add_argument("--dcn", help="axis sizes across slices / hosts (multi-slice), e.g. data=2")
    p.add_argument("--rules", help="rule set: dp, fsdp, tp, dp_tp, fsdp_tp; sequence-parallel dp_tp_sp, fsdp_tp_sp; "
                                   "expert-parallel dp_ep, fsdp_ep, fsdp_tp_ep (every set splits the length over seq)")
    p.add_argument("--steps", type=int, help="shorthand for --set run.steps=N, N >= 1 (the LR schedule ends with the run)")
    p.add_argument("--run-dir", help="shorthand for --set run.run_dir=DIR")
    p.add_argument("--simulate-devices", type=_count(0), default=0, metavar="N",
                   help="run on N simulated CPU devices (laptops, CI); 0 = the real devices")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--debug", action="store_true",
                   help="show the full traceback of an error (also: SPMD_DEBUG=1)")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the train step for --devices devices (abstract state, nothing allocated), print "
                        "memory, collectives and a roofline step time for --hardware, and exit")
    p.add_argument("--devices", type=_count(1), metavar="N", help="device count of the dry run (default: this backend's)")
    p.add_argument("--hardware", default="h100", help="dry-run target: h100, h200, a100, tpu-v4, tpu-v5e, tpu-v5p, cpu")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address for a multi-host run (default: $SPMD_COORDINATOR or cluster detection)")
    p.add_argument("--num-processes", type=int, help="processes in a multi-host run (default: $SPMD_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process's id in [0, num-processes) (default: $SPMD_PROCESS_ID)")
    p.add_argument("--init-timeout", type=int, metavar="S",
                   help="seconds to wait for all processes to join (default: $SPMD_INIT_TIMEOUT or 300)")
    return p.parse_args(argv)


def _error(message: object, code: int = EXIT_USAGE) -> int:
    print(f"spmd-train: error: {message}", file=sys.stderr)
    return code


_interrupted = threading.Event()  # Ctrl-C was pressed before the run's PreemptionWatcher took over
INTERRUPT_GRACE_S = 1.0  # after a first Ctrl-C the process is gone within this, whatever it was doing
_said = {"prog": "spmd-train", "note": "nothing was left half-written"}  # what the interrupt message says


def answer_ctrl_c(prog: str, note: str) -> None:
    """A command's Ctrl-C: stop within INTERRUPT_GRACE_S, even in C code, saying ``prog: interrupted (Ctrl-C);
    note`` and exiting 130. Only where SIGINT still has Python's default handler (not in tests or notebooks)."""
    _said.update(prog=prog, note=note)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_once)
        _watch_native_code()


def interrupted_message() -> str:
    return f"{_said['prog']}: interrupted (Ctrl-C); {_said['note']}"


def _interrupt_once(signum, frame) -> None:
    """First Ctrl-C: stop at the next Python instruction (and at the latest after INTERRUPT_GRACE_S, in
    case a library swallows the KeyboardInterrupt); the second one kills at once, even mid-compile."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _interrupted.set()
    if _importing(frame):  # a KeyboardInterrupt raised into a C extension's init aborts the process
        _exit_now(EXIT_INTERRUPTED, True)
    timer = threading.Timer(INTERRUPT_GRACE_S, _exit_now, (EXIT_INTERRUPTED, True))
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _importing(frame) -> bool:
    """Whether the main thread is inside an import (a native module initializing calls back into Python):
    raising there can abort the interpreter, and an import has written nothing, so the caller exits at once."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _watch_native_code() -> None:
    """Start the grace timer from a thread when Ctrl-C arrives while the main thread is inside C code
    (XLA making devices, a compile), where the Python handler cannot run until it returns: the C-level
    handler writes the signal to a wakeup pipe at once, and this thread reads it. While the run's
    PreemptionWatcher owns SIGINT (training: stop at the step, save, exit 76) it does nothing."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            if signal.SIGINT in os.read(read, 64) and signal.getsignal(signal.SIGINT) in (_interrupt_once, signal.SIG_DFL):
                timer = threading.Timer(INTERRUPT_GRACE_S, _exit_now, (EXIT_INTERRUPTED, True))
                timer.daemon = True
                timer.start()

    threading.Thread(target=watch, name="ctrl-c-watch", daemon=True).start()


def _exit_now(code: int, say: bool = False) -> None:
    """Leave without interpreter teardown: jax's compile threads and atexit hooks can crash it after an
    interrupt. Checkpoints are written atomically, so nothing on disk is half-done."""
    if say:
        print(interrupted_message(), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """``spmd-train``: parse, then run :func:`trainers.launch.command.run`; errors become one or two
    lines and an exit status (the traceback too with ``--debug`` or ``SPMD_DEBUG=1``)."""
    args = parse_args(argv)
    debug = args.debug or os.environ.get("SPMD_DEBUG", "") not in ("", "0")
    if argv is None:  # the run's PreemptionWatcher takes over once it has trained a step
        answer_ctrl_c("spmd-train", "nothing was left half-written")
    try:
        # imported after parsing: --help and --version answer without starting jax
        from meshes import MeshError
        from meshes.distributed import ConsistencyError, DistributedError
        from trainers.blame import ContractError, owner, task_frame
        from trainers.checkpoint import NoUsableCheckpointError
        from trainers.faults import DivergenceError
        from trainers.launch import command

        try:
            return command.run(args)
        except DivergenceError as e:
            return _report(e, EXIT_DIVERGED, debug)
        except DistributedError as e:
            return _report(e, EXIT_COORDINATOR, debug)
        except MeshError as e:
            return _report(e, EXIT_USAGE, debug, _mesh_hint(str(e), args))
        except OSError as e:
            return _report(e, EXIT_USAGE, debug, _path_hint(e, args))
        except (ValueError, ConsistencyError, NoUsableCheckpointError, ContractError) as e:
            return _report(e, EXIT_USAGE, debug)
        except Exception as e:  # a bug: say so, briefly, and how to see more
            if _interrupted.is_set():  # e.g. an import that Ctrl-C broke half-way
                raise KeyboardInterrupt from e
            if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():  # the config's, not a bug
                return _report(e, EXIT_USAGE, debug, _oom_hint(args), text="out of device memory: "
                               + next((line for line in str(e).splitlines() if line.strip()), type(e).__name__))
            if owner(e) == "task":  # raised in the task's code (wherever it is installed): the task's error
                return _report(e, EXIT_USAGE, debug, text=f"the task's code raised {type(e).__name__}: {e}"
                               f"{task_frame(e)}; the error is in that code, not in the toolkit"
                               + ("" if debug else " (--debug shows the traceback)"))
            if debug:
                traceback.print_exc()
            return _error(f"internal error: {type(e).__name__}: {e}"
                          + ("" if debug else " (rerun with --debug for the traceback)"), EXIT_INTERNAL)
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt) and not (_interrupted.is_set() and isinstance(e, Exception)):
            raise
        print(interrupted_message(), file=sys.stderr)
        if argv is None:
            _exit_now(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED


def _report(e: BaseException, code: int, debug: bool, hint: str = "", text: str = "") -> int:
    if debug:
        traceback.print_exc()
    if not text and isinstance(e, OSError) and e.filename:  # raw "[Errno 30] ...": say which path and which key
        text = f"cannot use {e.filename!r}: {e.strerror or e}"
    return _error((text or str(e).strip() or type(e).__name__) + hint, code)


def _path_hint(e: OSError, args: argparse.Namespace) -> str:
    """Which config key a path in an OS error comes from: the run directory's, or the others that name paths."""
    if not e.filename:
        return ""
    path = os.path.abspath(os.fspath(e.filename))
    run_dir = os.path.abspath(args.run_dir) if args.run_dir else None
    if (run_dir and path.startswith(run_dir)) or (not run_dir and f"{os.sep}runs{os.sep}" in path + os.sep):
        return ("\n  (the run writes under run.run_dir, set with --run-dir, and checkpoints under checkpoint.directory; "
                "give a directory this user can write)")
    return ("\n  (paths come from data.path, data.tokenizer, --config, run.run_dir / --run-dir, checkpoint.directory "
            "and checkpoint.init_from)")


def _oom_hint(args: argparse.Namespace) -> str:
    """Where the memory estimate is and the changes that lower it, as flags of this command."""
    devices = args.simulate_devices or "N"
    return (f"\n  estimate per-device memory first: spmd-train {args.target} --dry-run --devices {devices} --hardware H "
            f"(the same flags); spmd-plan {args.target} --devices {devices} --hardware H lists layouts that fit\n"
            "  what lowers it: --set model.remat_policy=full (recompute activations), a larger fsdp axis "
            "(--mesh fsdp=-1), a smaller data.global_batch or run.grad_accum > 1")


def _mesh_hint(message: str, args: argparse.Namespace) -> str:
    """Where the mesh comes from, and on a one-device machine the likely fix."""
    hint = "\n  (the mesh is mesh.axes, set with --mesh; mesh.dcn with --dcn)"
    if not args.simulate_devices and re.search(r"there (is|are) 1 device", message):
        hint += ("\n  (no accelerator here? pass --simulate-devices N to run on N simulated CPU devices, "
                 "e.g. --simulate-devices 8)")
    return hint


if __name__ == "__main__":
    sys.exit(main())
