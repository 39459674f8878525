"""``python lightning_cpu.py SCRIPT ARGS``: run a Lightning script on CPU.

Lightning's DeepSpeed strategy refuses a CPU in two checks: ``setup_environment`` (the
accelerator must be CUDA) and ``_validate_device_index_selection`` (the devices must be
indexed CUDA devices). This lifts those two checks (the parent class's set-up runs as it
would) and runs SCRIPT unchanged. Used by tests/test_lightning_deepspeed.py."""

import runpy
import sys

import lightning.pytorch.strategies.deepspeed as lightning_deepspeed
from lightning.pytorch.strategies.ddp import DDPStrategy

lightning_deepspeed.DeepSpeedStrategy.setup_environment = DDPStrategy.setup_environment
lightning_deepspeed._validate_device_index_selection = lambda parallel_devices: None

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
