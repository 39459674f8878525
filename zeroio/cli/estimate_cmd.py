"""`zeroio estimate`: training-state memory per GPU, per node's CPU and on NVMe.

    zeroio estimate --params 7.5B --gpus-per-node 8 --nodes 8 --stage 3 \
        [--offload-optimizer none|cpu|nvme] [--offload-param none|cpu|nvme] \
        [--dtype bf16|fp16|fp32] [--config C] [--no-buffers] [--json]
    zeroio estimate --model-config path/to/config.json (or the model folder) ...
    zeroio estimate --plan --params 13B --machine machine.json   (zeroio/cli/estimate_plan.py)

--model-config takes the parameter count (and stage 3's largest flat group, one
decoder layer) from a Llama-style Hugging Face config.json, read as plain JSON.
The arithmetic imports no torch (an answer in a fraction of a second), except
with offload_optimizer cpu, where the CPU Adam plan decides the host gradient's
dtype. With --config, stage, offload devices, dtype and the bucket/buffer sizes come
from that file unless given on the command line. The model behind the
numbers is documented in zeroio/estimate.py.
"""

from __future__ import annotations

import dataclasses
import json

from zeroio.cli import estimate_plan
from zeroio.errors import ConfigError

_GB = 1e9


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="memory per GPU, CPU and NVMe for a model and config",
                       description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="number of model parameters: 7.5e9, 1.4B, 350M, 125k")
    src.add_argument("--model-config", metavar="config.json",
                     help="a Llama-style config.json (or its folder): the shape is read from it")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs (ranks) per node (default 1, or the --machine file's)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage (default: the config's, else 3)")
    p.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default=None)
    p.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default=None)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="16-bit training dtype (default: the config's, else bf16)")
    p.add_argument("--ratio", type=float, default=None,
                   help="offload_optimizer.ratio: the fraction of the optimizer state offloaded "
                        "(stages 1-3; the rest stays on the GPU); default the config's or 1.0")
    p.add_argument("--config", default=None, help="a DeepSpeed/zeroio JSON config")
    p.add_argument("--no-buffers", action="store_true",
                   help="model states only, as the ZeRO paper counts them")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    estimate_plan.add_arguments(p)
    p.set_defaults(func=run)


def _gb(n: int) -> str:
    return f"{n / _GB:10.2f}"


def check_args(args) -> None:
    """Every option of `estimate` checked before any arithmetic (ConfigError, exit 2, naming
    the flag); the --model-config file is checked where it is read (``model_shape``)."""
    for name in ("gpus_per_node", "nodes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}", key=name)
    if args.ratio is not None and not 0 < args.ratio <= 1:
        raise ConfigError(f"--ratio {args.ratio:g}: expected a number in (0, 1] (the fraction of "
                          "the optimizer state offloaded)", key="ratio")
    estimate_plan.check_args(args)


def run(args) -> int:
    from zeroio.config import load_config
    from zeroio.estimate import estimate_memory

    check_args(args)
    shape = None
    if args.model_config is not None:
        from zeroio.estimate import model_shape

        shape = model_shape(args.model_config)
    if args.plan:
        return estimate_plan.run(args, shape)
    config = load_config(args.config) if args.config else None
    report = estimate_memory(
        shape.num_params if shape else args.params,
        1 if args.gpus_per_node is None else args.gpus_per_node, args.nodes,
        stage=args.stage, largest_group=shape.layer_params if shape else None,
        offload_optimizer=args.offload_optimizer, offload_param=args.offload_param,
        dtype=args.dtype, config=config, zeroio_buffers=not args.no_buffers, ratio=args.ratio)
    if args.json:
        out = report.to_dict()
        if shape is not None:
            out["model"] = dataclasses.asdict(shape)
        print(json.dumps(out))
        return 0
    r = report
    if shape is not None:
        print(f"{shape.source}: hidden {shape.hidden}, intermediate {shape.intermediate}, "
              f"{shape.layers} layers, {shape.heads} heads ({shape.kv_heads} key/value), vocab "
              f"{shape.vocab}, embeddings {'tied' if shape.tied else 'untied'}")
    print(f"{r.num_params:,} parameters, {r.gpus_per_node} GPU(s) x {r.nodes} node(s), "
          f"ZeRO stage {r.stage}, {r.dtype}, offload optimizer={r.offload_optimizer} "
          f"param={r.offload_param}")
    print(f"{'term':42s} {'tier':5s} {'GB/GPU':>10s}  formula")
    for item in r.items:
        print(f"{item.name:42s} {item.tier:5s} {_gb(item.bytes_per_gpu)}  {item.formula}")
    print(f"GPU memory per GPU:   {_gb(r.gpu_bytes_per_gpu)} GB")
    print(f"CPU memory per node:  {_gb(r.cpu_bytes_per_node)} GB")
    print(f"NVMe space per node:  {_gb(r.nvme_bytes_per_node)} GB")
    print("(GB = 1e9 bytes; activations and CUDA context not included)")
    return 0
