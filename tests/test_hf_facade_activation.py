"""Activating the ``deepspeed`` facade: only on request, and as transformers, accelerate and
TRL check for DeepSpeed (``find_spec`` plus distribution metadata and version).

Each case runs in a fresh interpreter (activation is process-wide). References: the
libraries' own ``is_deepspeed_available`` functions and ``importlib.metadata``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zeroio.testing.hf_scripts import REPO
from zeroio.testing.multirank import outside_launcher_env

pytest.importorskip("transformers")
pytest.importorskip("trl")

_PROBE = """
import importlib.metadata, importlib.util, json, sys
{before}
import transformers.integrations.deepspeed as tid
from accelerate.utils import is_deepspeed_available as acc
from trl.import_utils import is_deepspeed_available as trl_has
def version():
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None
out = {{"transformers": bool(tid.is_deepspeed_available()), "accelerate": bool(acc()),
       "trl": bool(trl_has()),
       "version": version(), "hf_base": tid.HfDeepSpeedConfig.__mro__[1].__module__}}
{after}
out["ds_numel_attr"] = hasattr(__import__("torch").nn.Parameter, "ds_numel")
print(json.dumps(out))
"""


def _probe(before: str, after: str = "") -> dict:
    code = _PROBE.format(before=before, after=after)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=outside_launcher_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_zeroio_alone_patches_nothing():
    out = _probe("import zeroio, zeroio.integrations.hf_config")
    assert out == {"transformers": False, "accelerate": False, "trl": False, "version": None,
                   "hf_base": "builtins", "ds_numel_attr": False}


def test_one_import_line_makes_every_library_see_deepspeed():
    out = _probe("import zeroio.integrations.transformers")
    import zeroio.deepspeed

    assert out == {"transformers": True, "accelerate": True, "trl": True,
                   "version": zeroio.deepspeed.__version__,
                   "hf_base": "accelerate.utils.deepspeed", "ds_numel_attr": True}


def test_one_import_after_transformers_rebinds_its_deepspeed_config():
    """transformers imported first picked ``object`` as HfDeepSpeedConfig's base; the import
    line re-executes that module so ``TrainingArguments(deepspeed=...)`` works."""
    out = _probe("", after="import zeroio.deepspeed\nout['hf_base'] = "
                 "tid.HfDeepSpeedConfig.__mro__[1].__module__\nout['transformers'] = "
                 "tid.is_deepspeed_available()")
    assert out["hf_base"] == "accelerate.utils.deepspeed" and out["transformers"] is True


def test_one_import_after_accelerate_gives_the_trainer_its_deepspeed_names():
    """accelerate.utils imported before the facade skipped its DeepSpeed exports; the import
    line adds them, so a later ``transformers.trainer`` import (which imports
    DeepSpeedSchedulerWrapper when DeepSpeed is available) works."""
    out = _probe("", after="import zeroio.integrations.transformers\n"
                 "from transformers import Trainer\n"
                 "from accelerate.utils import DeepSpeedSchedulerWrapper\n"
                 "import accelerate.accelerator as aa\n"
                 "out['trainer'] = Trainer.__name__\n"
                 "out['wrapper'] = aa.DeepSpeedSchedulerWrapper is DeepSpeedSchedulerWrapper")
    assert out["trainer"] == "Trainer" and out["wrapper"] is True
