"""`zeroio train`: train a decoder-only language model end to end (the main job).

With no arguments: the tiny Llama preset on the built-in corpus, one rank per
visible GPU (2 on a machine without CUDA),
ZeRO stage 3 with parameters and optimizer state on NVMe under
./zeroio_run/nvme, checkpoints under ./zeroio_run/checkpoints and a
from_pretrained model in ./zeroio_run/model.

When not already under a launcher (no RANK in the environment) and --nproc
is above 1, every argument and config error is checked once (exit 2), then the
command re-runs itself on --nproc processes through ``torch.distributed.run``
(the same path as ``zeroio launch``, each rank dying with it); each process
then runs the job in ``zeroio/cli/train/loop.py``.

With ``--plan`` (the default for ``--model-config`` without ``--config``) the placement is
planned once per job for the machine, before any rank starts
(``zeroio/cli/train/placement.py``, [Note: planned runs]).

[Note: stopping on a signal] SIGTERM (a scheduler's preemption) and SIGINT are deferred by
``run`` (zeroio.preemption.[Note: signals at the step boundary]); the loop
asks at each step boundary, all ranks together, whether to stop. On a stop the step that was
running has finished, a checkpoint of it is written (unless --no-checkpoint, or
--no-checkpoint-on-signal), no model is exported, the engine closes (its swap folders go),
rank 0 prints one line on stderr (and the JSON summary with --json, ``stopped_by`` and
``exit_code`` set) and every rank exits 128 + the signal (143 SIGTERM, 130 SIGINT).
``--resume`` continues from that checkpoint exactly as an uninterrupted run would have.
"""

from __future__ import annotations

import os

# option name -> (argparse kwargs); the TrainOptions field is the dest
_OPTIONS: dict[str, dict] = {
    "--config": dict(default=None, metavar="FILE",
                     help="DeepSpeed-schema JSON config (default: built-in stage 3 + NVMe offload)"),
    "--preset": dict(default=None, metavar="NAME",
                     help="model preset: tiny (default), small, 125m, 350m, 1b, 7b, 13b"),
    "--model-config": dict(default=None, metavar="config.json",
                           help="a transformers config.json (or its folder) instead of a preset"),
    "--data": dict(default=None, metavar="PATH",
                   help="text file or folder of .txt/.md files (default: built-in corpus)"),
    "--steps": dict(type=int, default=200, help="optimizer steps (default 200)"),
    "--seq-len": dict(type=int, default=128, help="tokens per sequence (default 128)"),
    "--micro-batch": dict(type=int, default=None,
                          help="sequences per rank per micro-step (default: config, or 4)"),
    "--grad-accum": dict(type=int, default=None, metavar="N",
                         help="micro-steps per optimizer step, gradient_accumulation_steps "
                              "(default: config, or 1); a step trains on micro batch x N x "
                              "ranks sequences"),
    "--lr": dict(type=float, default=None,
                 help="peak learning rate (default: config, or 3e-3 tiny/small, 3e-4 larger)"),
    "--warmup": dict(type=int, default=None, help="warmup steps (default 10%% of --steps)"),
    "--stop-after": dict(type=int, default=None, metavar="N",
                         help="stop this run after step N of the --steps schedule (checkpoint "
                              "written; continue later with --resume)"),
    "--save-every": dict(type=int, default=0, metavar="N",
                         help="checkpoint every N steps (default: only at the end)"),
    "--keep-last": dict(type=int, default=None, metavar="N",
                        help="keep only the newest N checkpoints, removing older ones zeroio "
                             "wrote after each save (checkpoint.keep_last; like the HF "
                             "Trainer's save_total_limit; default: keep all)"),
    "--output": dict(default="zeroio_run", metavar="DIR",
                     help="run folder: nvme/, checkpoints/, model/ (default ./zeroio_run); one "
                          "run at a time (DIR/zeroio.lock)"),
    "--tag": dict(default=None, metavar="TAG",
                  help="with --resume: continue from checkpoint TAG (e.g. step100) instead of "
                       "the newest"),
    "--seed": dict(type=int, default=1234, help="model init and data order seed"),
    "--model-dtype": dict(default="fp32", choices=("fp32", "bf16"),
                          help="dtype of the final from_pretrained model (default fp32, the masters; "
                               "bf16 halves its bytes)"),
    "--ratio": dict(type=float, default=None, metavar="R",
                    help="zero_optimization.offload_optimizer.ratio: offload this fraction of "
                         "each rank's optimizer state, keep the rest on the GPU (stages 1-3; "
                         "default: the config's, or 1)"),
    "--progress-every": dict(type=int, default=0, metavar="N",
                             help="also print one plain progress line on stderr every N steps, "
                                  "even under --json or --quiet (default 0: none)"),
    "--timeout": dict(type=float, default=None, metavar="SECONDS",
                      help="distributed.timeout_s: how long a collective waits for a rank that "
                           "stopped answering before the run fails naming it (default: the "
                           "config's, or 600)"),
    "--machine": dict(default=None, metavar="machine.json",
                      help="with --plan: plan for this machine (zeroio estimate --plan's JSON) "
                           "instead of measuring the one the run is on; implies --plan"),
    "--nvme-path": dict(default=None, metavar="DIR",
                        help="nvme_path of the built-in or planned config, and where --plan "
                             "measures the disk (default: DIR/nvme of --output)"),
}
_FLAGS = {
    "--resume": "continue from the newest checkpoint under DIR/checkpoints (or --tag's)",
    "--overwrite": "let a fresh run delete files zeroio did not write in DIR/model, "
                   "DIR/checkpoints and DIR/nvme (without it the run refuses to start)",
    "--quiet": "no progress bar, only the final summary",
    "--json": "print one JSON summary on stdout and nothing else",
    "--no-checkpoint": "write no training checkpoint, only the final model (from the live engine); "
                       "not with --resume, --save-every or --stop-after",
    "--no-checkpoint-on-signal": "on SIGTERM or SIGINT stop at the step boundary without "
                                 "writing a checkpoint there (default: write one, then exit "
                                 "143 / 130)",
}


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a decoder-only language model end to end",
                       description=__doc__.split("\n\n")[1])
    for name, kw in _OPTIONS.items():
        p.add_argument(name, **kw)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (default: the number of visible GPUs, 2 without CUDA; "
                        "ignored under a launcher)")
    for name, help_ in _FLAGS.items():
        p.add_argument(name, action="store_true", help=help_)
    plan = p.add_mutually_exclusive_group()
    plan.add_argument("--plan", dest="plan", action="store_const", const=True, default=None,
                      help="measure this machine (or read --machine) and choose the stage, "
                           "offload and ratio that fit it, printed before step 1 (the default "
                           "with --model-config and no --config)")
    plan.add_argument("--no-plan", dest="plan", action="store_const", const=False,
                      help="train with the given or built-in config's placement as it is")
    p.set_defaults(func=run_in_dir)


def _dest(name: str) -> str:
    return name[2:].replace("-", "_")


def _given(args) -> frozenset[str]:
    """Options set to something other than their default (taken as typed by the user)."""
    return frozenset(_dest(n) for n, kw in _OPTIONS.items() if getattr(args, _dest(n)) != kw["default"])


def child_argv(args) -> list[str]:
    """The `zeroio train` arguments each launched rank gets (the user's, minus --nproc)."""
    argv = ["train"]
    for name, kw in _OPTIONS.items():
        value = getattr(args, _dest(name))
        if value != kw["default"]:
            argv += [name, str(value)]
    plan = {True: ["--plan"], False: ["--no-plan"], None: []}[args.plan]
    return argv + [name for name in _FLAGS if getattr(args, _dest(name))] + plan


def default_nproc() -> int:
    """One rank per visible GPU; 2 gloo ranks on a machine without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def run_in_dir(args) -> int:
    """`run` holding the run directory's lock, taken once per job before any rank starts
    ([Note: run directory] in zeroio/cli/train/rundir.py), after every option, file and
    config was checked ([Note: checked before anything is written] in
    zeroio/cli/train/options.py): a mistake leaves nothing behind."""
    from pathlib import Path

    import torch

    from zeroio.cli.train import rundir
    from zeroio.cli.train.options import check_job
    from zeroio.config.launch_env import launch_env

    opts = options(args)
    nproc = job_nproc(args)
    launched = launch_env().world_size
    mcfg, _ = check_job(opts, nproc if launched is None else launched,
                        cuda=torch.cuda.is_available())
    with rundir.claim(Path(args.output), resume=args.resume, overwrite=args.overwrite):
        return run(args, opts, nproc, mcfg)


def job_nproc(args) -> int:
    """--nproc, or one rank per visible GPU (2 gloo ranks without CUDA)."""
    from zeroio.errors import ConfigError

    nproc = args.nproc if args.nproc is not None else default_nproc()
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}", key="nproc")
    return nproc


def options(args):
    """The parsed command line as ``TrainOptions``."""
    from zeroio.cli.train.options import TrainOptions

    return TrainOptions(**{_dest(n): getattr(args, _dest(n)) for n in (*_OPTIONS, *_FLAGS)},
                        plan=args.plan, given=_given(args))


def _job_plan(opts, mcfg, nproc: int):
    """The placement plan, made once per job ([Note: planned runs] in
    zeroio/cli/train/placement.py); None in a rank its launcher planned for, or unplanned."""
    from pathlib import Path

    import torch

    from zeroio.cli.train import placement, rundir

    if "RANK" in os.environ and rundir.launched_by_holder(Path(opts.output)):
        return None
    return placement.job_plan(opts, mcfg, nproc=nproc, cuda=torch.cuda.is_available())


def run(args, opts, nproc: int, mcfg) -> int:
    from zeroio.cli.train.loop import train

    run_plan = _job_plan(opts, mcfg, nproc)
    if "RANK" not in os.environ and nproc > 1:
        if run_plan is not None:  # the planned config is checked once here too, not per rank
            import torch

            from zeroio.cli.train.options import check_job

            check_job(opts, nproc, cuda=torch.cuda.is_available(), zero=run_plan.zero)
        from zeroio.cli.launch_cmd import launch, torchrun_argv
        from zeroio.partition.step_overlap import cpu_share

        # one intra-op thread per rank per core share: ranks on a small machine must not fight
        os.environ.setdefault("OMP_NUM_THREADS", str(cpu_share(nproc)))
        # a signalled rank finishes its step and writes a checkpoint before it exits: give it
        # longer than torch's 30 s before the launcher's SIGKILL (the scheduler's grace still
        # bounds it)
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
        return launch(torchrun_argv("zeroio.cli.main", child_argv(args), nproc=nproc, module=True,
                                    guard=True))

    from zeroio.io import progress
    from zeroio.preemption import deferred_signals

    # SIGTERM / SIGINT wait for the step boundary ([Note: stopping on a signal]); --quiet and
    # --json silence initialize's bars too (zeroio/io/progress.py)
    with deferred_signals() as signals, progress.quiet(opts.quiet or opts.json):
        try:
            train(opts, run_plan, signals)
        finally:
            from zeroio.partition import collectives

            collectives.destroy_world()
    return signals.exit_code
