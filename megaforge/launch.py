"""What the launchers run: parse the config, start the run, report errors without a traceback
wall for problems the user can fix (config, data, run directory)."""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys

from megaforge import planner, startup
from megaforge.build import RunBuilder
from megaforge.config import load_config
from megaforge.configtree import ConfigError
from megaforge.data.sources import DataError
from megaforge.planner import FlagError, dry_run, split_argv
from megaforge.supervise import die_with_parent

#: failures of the disk, not of megaforge: reported as one line naming the path and the cause
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def die_with_agent() -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), this worker gets SIGKILL when its elastic
    agent dies (``PR_SET_PDEATHSIG``): an orphaned worker must not go on training while a
    ``--resume`` of the same run starts (the run directory's lock refuses that resume until the
    orphan is gone). Started after the agent died already: exit at once. Plain ``python
    launchers/grpo.py`` (e.g. under nohup) is left alone."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    if not die_with_parent(signal.SIGKILL):
        print(f"megaforge: warning: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this worker "
              f"would outlive its torchrun agent", file=sys.stderr, flush=True)
    if os.getppid() == 1:  # adopted by init: the agent is gone
        print("megaforge: error: the torchrun agent of this worker has exited", file=sys.stderr, flush=True)
        raise SystemExit(1)


def main(mode: str, argv=None) -> None:
    die_with_agent()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print("Dry run (the plan only: no run directory, no weights), launcher flags "
              + planner.__doc__.split("Launcher flags", 1)[1].strip() + "\n")
    try:
        plan_opts, argv = split_argv(argv)  # --dry_run and its flags (megaforge.planner)
        cfg = load_config(argv)
        startup.resolve(cfg, mode, bool(plan_opts.get("dry_run")))  # names resolved (also in --dry_run)
    except (ConfigError, FlagError) as e:
        print(f"megaforge: config error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if plan_opts.get("dry_run"):
        path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), "")
        raise SystemExit(dry_run(RunBuilder(cfg).plan_input(), mode, plan_opts, path))
    # lazy: these import torch and the trainer (seconds); --help and --dry_run answer before them
    import torch.distributed  # lazy: as above
    from megaforge import cluster, collective  # lazy: as above
    from megaforge.driver.common import RunError, RunStopped  # lazy: as above
    from megaforge.hf import DeviceError, ModelSourceError  # lazy: as above
    from megaforge.loop import run_grpo, run_sft  # lazy: as above
    from megaforge.metrics import run_summary  # lazy: as above

    job = cluster.Job()  # this rank's part in the job: its watchdog, its node's engine servers
    together = False  # the run ended the same way on every rank (done, or a shared stop)
    try:
        if mode == "grpo":
            run = run_grpo(cfg, job)
        elif mode == "sft":
            run = run_sft(cfg, job)
        else:
            raise ValueError(f"unknown launcher mode {mode!r}")
        together = True
        if collective.is_main():
            print(run_summary(run.run_dir), flush=True)  # folder, first -> last, the plot command
    except RunStopped as e:
        together = True
        print(f"megaforge: {e}", file=sys.stderr)
        raise SystemExit(143)
    except (ConfigError, DataError, RunError, DeviceError, ModelSourceError) as e:
        job.report_failure(e)  # the other ranks exit within launch.abort_grace_s (megaforge.cluster)
        kind = "config error" if isinstance(e, ConfigError) else "error"  # e.g. a LoRA target the model lacks
        print(f"megaforge: {kind}: {e}", file=sys.stderr)
        raise SystemExit(1)
    except OSError as e:
        job.report_failure(e)
        if e.errno not in DISK_ERRORS:
            raise
        where = f" ({e.filename})" if e.filename else ""
        print(f"megaforge: error: writing the run's files failed{where}: {os.strerror(e.errno)} "
              f"({errno.errorcode[e.errno]}); free space and continue with --resume", file=sys.stderr)
        raise SystemExit(1)
    except BaseException as e:
        job.report_failure(e)
        raise
    finally:
        # engine servers this node's leader started (after a barrier when together), then the watchdog
        # stops (when together: after that barrier, which it still guards)
        job.end(together)
        if collective.initialized():
            torch.distributed.destroy_process_group()
