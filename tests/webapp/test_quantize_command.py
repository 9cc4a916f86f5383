"""``manage.py quantize`` refuses bad arguments before loading the model (the quantization itself is
tested in tests/inference/test_quantization_engine.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from webapp import launcher


@pytest.mark.parametrize("flags, message", [
    (["--quantization", "awq", "--group-size", "100"], "group_size=100 must be -1 or a multiple of 16"),
    (["--quantization", "awq", "--desc-act"], "--desc-act and --no-desc-act apply to GPTQ only"),
    (["--quantization", "awq", "--no-desc-act"], "--desc-act and --no-desc-act apply to GPTQ only"),
    (["--quantization", "awq", "--static-groups"], "--static-groups, --desc-act"),
    (["--quantization", "gptq", "--model", "{awq}"], "is already quantized (quant_method 'awq')"),
    (["--quantization", "gptq", "--output-dir", ""], "--output-dir is empty"),
    (["--quantization", "gptq", "--desc-act", "--no-desc-act"], "not allowed with argument"),
    (["--quantization", "awq", "--device", "gpu"], "--device 'gpu' is not a device name"),
    (["--quantization", "gptq", "--seq-len", "100000"], "seq_len=100000 is longer than the model's 8192 positions"),
    (["--quantization", "gptq", "--output-dir", "/dev/null/x"], "cannot be created: /dev/null is not a writable"),
    pytest.param(["--quantization", "awq", "--device", "cuda"], "this machine has no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine can quantize there")),
])
def test_quantize_command_names_the_bad_argument(tmp_path, flags, message):
    if "{awq}" in flags:  # a checkpoint that is already quantized, as its config says
        source = tmp_path / "awq-model"
        source.mkdir()
        (source / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}}))
        (source / "model.safetensors").write_bytes(b"")
        flags = [str(source) if f == "{awq}" else f for f in flags]
    env = launcher.child_env(REDIS_URL=None, TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    done = subprocess.run([sys.executable, launcher.MANAGE, "quantize", "--output-dir", str(tmp_path / "out"), *flags],
                          env=env, capture_output=True, text=True, timeout=120, cwd=launcher.BASE_DIR)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_an_occupied_output_dir_is_refused_before_calibrating(tmp_path):
    taken = tmp_path / "config.json"
    taken.write_text("{}")
    env = launcher.child_env(REDIS_URL=None, TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    done = subprocess.run([sys.executable, launcher.MANAGE, "quantize", "--output-dir", str(taken),
                           "--quantization", "awq"], env=env, capture_output=True, text=True, timeout=120,
                          cwd=launcher.BASE_DIR)
    assert done.returncode != 0 and "exists and is not an empty directory" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and taken.read_text() == "{}"
