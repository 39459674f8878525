"""Config files that are not clean JSON: bytes that are not UTF-8, and duplicate keys.

Both are a ConfigError naming the file (and the byte offset, or the key path of
the repeated key), from the library's loader and from `zeroio train --config`
alike; never a UnicodeDecodeError, never "the last value wins".
"""

from __future__ import annotations

import pytest

from zeroio.config import load_config
from zeroio.errors import ConfigError
from zeroio.testing.train_cli import train_here

GOOD = b'{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}'


def test_non_utf8_file_names_the_file_and_the_byte_offset(tmp_path):
    path = tmp_path / "ds_config.json"
    bad = GOOD.replace(b'"stage"', b'"st\xe4ge"')  # latin-1 a-umlaut, as an editor might save it
    path.write_bytes(bad)
    offset = bad.index(b"\xe4")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and f"byte {offset}" in msg and "UTF-8" in msg, msg
    assert not isinstance(e.value, UnicodeDecodeError)


@pytest.mark.parametrize("text, key", [
    ('{"zero_optimization": {"stage": 2, "stage": 3}}', "zero_optimization.stage"),
    ('{"train_batch_size": 8, "train_batch_size": 16}', "train_batch_size"),
    ('{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "lr": 2e-3}}}',
     "optimizer.params.lr"),
    ('{"zero_optimization": {"offload_param": {"device": "cpu", "device": "nvme"}}}',
     "zero_optimization.offload_param.device"),
    ('{"x": [{"a": 1}, {"b": 1, "b": 2}]}', "x[1].b"),
])
def test_duplicate_key_is_a_config_error_naming_the_key_path(tmp_path, text, key):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.key == key
    assert key in str(e.value) and str(path) in str(e.value), str(e.value)


def test_same_key_in_different_objects_is_fine(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},'
                    ' "fp16": {"enabled": false}, "bf16": {"enabled": false}}')
    from zeroio.config.loader import read_config

    raw = read_config(path)
    assert raw["fp16"] == {"enabled": False} and raw["zero_optimization"]["stage"] == 1
    assert type(raw["zero_optimization"]) is dict  # plain dicts come back, whatever the parser used
    assert load_config(path).zero_optimization.stage == 1


@pytest.mark.slow
@pytest.mark.parametrize("content, words", [
    (GOOD.replace(b"2}", b"2, \"c\xff\": 1}"), ["UTF-8", "byte"]),
    (b'{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "stage": 3}}',
     ["zero_optimization.stage", "twice"]),
])
def test_train_cli_reports_the_file_before_launching(tmp_path, content, words):
    cfg = tmp_path / "bad.json"
    cfg.write_bytes(content)
    out = tmp_path / "run"
    # refused before any rank starts: the command's own main, in this process
    proc = train_here(out, ["--config", str(cfg), "--steps", "1", "--nproc", "2"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "UnicodeDecodeError" not in proc.stderr, proc.stderr
    assert str(cfg) in proc.stderr and all(w in proc.stderr for w in words), proc.stderr
    assert "torch.distributed" not in proc.stderr  # refused in the parent, no rank was launched
    assert not out.exists()
