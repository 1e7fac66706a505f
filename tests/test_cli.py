"""The `pdserve` command line: the documented forms, and one clear line for every user error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pdserve.launch.cli import main


def run_cli(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_chat_prints_parsed_harmony_reply(tiny_mxfp4, capsys):
    code, out, err = run_cli(capsys, "generate", "--model", tiny_mxfp4, "--chat", "hi", "--max-new-tokens", 12,
                             "--seed", 0, "--json")
    assert code == 0, err
    reply = json.loads(out)
    assert reply["completion_tokens"] == len(reply["output_ids"]) > 0
    assert reply["prompt_tokens"] > 10  # the Harmony system + user message
    assert set(reply) >= {"content", "reasoning_content", "tool_calls", "finish_reason"}
    code, out, _ = run_cli(capsys, "generate", "--model", tiny_mxfp4, "--chat", "hi", "--max-new-tokens", 5, "--seed", 0)
    assert code == 0 and "[assistant]" in out and "[finish]" in out


def test_generate_is_seeded(tiny_mxfp4, capsys):
    args = ("generate", "--model", tiny_mxfp4, "--prompt-ids", "1,2,3", "--max-new-tokens", 6, "--seed", 5)
    assert run_cli(capsys, *args)[1] == run_cli(capsys, *args)[1]
    code, out, _ = run_cli(capsys, "generate", "--model", tiny_mxfp4, "--prompt", "Hello", "--max-new-tokens", 3,
                           "--temperature", 0)
    assert code == 0 and out.strip()


def test_logits_writes_float32_every_position(tiny_mxfp4, tiny_runner, tmp_path, capsys):
    out = tmp_path / "l.npy"
    code, _, err = run_cli(capsys, "logits", "--model", tiny_mxfp4, "--prompt-ids", "5,6,7,8", "--out", out,
                           "--precision", "bf16")
    assert code == 0, err
    arr = np.load(out)
    assert arr.shape == (4, 201088) and arr.dtype == np.float32
    np.testing.assert_array_equal(arr, tiny_runner.prompt_logits([5, 6, 7, 8]).numpy())


@pytest.mark.parametrize("case", ["missing", "corrupt-config", "unsupported", "bad-ids", "out-of-range",
                                  "too-long", "empty-shard", "bad-temperature", "exists"])
def test_user_errors_are_one_line(case, tiny_mxfp4, tmp_path, capsys):
    model = tmp_path / "m"
    args = ["logits", "--model", model, "--prompt-ids", "1,2", "--out", tmp_path / "x.npy"]
    if case == "missing":
        pass
    elif case in ("corrupt-config", "unsupported", "empty-shard"):
        shutil.copytree(tiny_mxfp4, model)
        if case == "corrupt-config":
            (model / "config.json").write_text("{")
        elif case == "unsupported":
            cfg = json.loads((model / "config.json").read_text())
            (model / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
        else:
            for f in model.glob("model-*.safetensors"):
                f.write_bytes(b"")
    elif case == "bad-ids":
        args = ["logits", "--model", tiny_mxfp4, "--prompt-ids", "1,x", "--out", tmp_path / "x.npy"]
    elif case == "out-of-range":
        args = ["logits", "--model", tiny_mxfp4, "--prompt-ids", "1,201088", "--out", tmp_path / "x.npy"]
    elif case == "too-long":
        ids = ",".join(["7"] * 4096)
        args = ["generate", "--model", tiny_mxfp4, "--prompt-ids", ids]
    elif case == "bad-temperature":
        args = ["generate", "--model", tiny_mxfp4, "--prompt-ids", "1", "--temperature", "-1"]
    elif case == "exists":
        args = ["make-checkpoint", tiny_mxfp4, "--config", "tiny", "--seed", "0"]
    code, out, err = run_cli(capsys, *args)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve ") and "error:" in lines[0], err
    assert "Traceback" not in err


def test_entry_point_and_convert(tiny_mxfp4, tmp_path):
    env = dict(os.environ)
    dst = tmp_path / "fp8"
    p = subprocess.run([sys.executable, "-m", "pdserve.launch.cli", "convert", str(tiny_mxfp4), str(dst)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "100.0%" in p.stdout and (dst / "config.json").is_file()
    p = subprocess.run([sys.executable, "-m", "pdserve.launch.cli", "generate", "--model", str(tmp_path / "nope"),
                        "--prompt-ids", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
