"""The `pdserve` command line: the documented forms, and one clear line for every user error."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

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


@pytest.mark.parametrize("flag,bound", [("--attention-precision", 8e-2), ("--unembedding-precision", 4e-2)])
def test_logits_with_fp8_projections(flag, bound, tiny_mxfp4, tiny_runner, tmp_path, capsys):
    """--attention-precision fp8 (QKV and O weights) and --unembedding-precision fp8 (the vocabulary
    projection's) reach the model: different logits, within the engine's bounds (docs/engine.md)."""
    out = tmp_path / "l.npy"
    code, _, err = run_cli(capsys, "logits", "--model", tiny_mxfp4, "--prompt-ids", "5,6,7,8", "--out", out,
                           "--precision", "bf16", flag, "fp8")
    assert code == 0, err
    got, bf16 = torch.from_numpy(np.load(out)), tiny_runner.prompt_logits([5, 6, 7, 8])
    err = float((got.double() - bf16.double()).norm() / bf16.double().norm())
    assert 0 < err < bound


@pytest.mark.parametrize("flag", ["--attention-precision", "--unembedding-precision"])
def test_serve_passes_projection_precisions_to_the_workers(flag):
    """serve's precision flags reach both worker pools' command lines (workers parse them alike)."""
    from pdserve.launch.cli import projection_precision_argv, projection_precisions
    from pdserve.launch.serve import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args([flag, "fp8"])
    argv = projection_precision_argv(a)
    assert argv[argv.index(flag) + 1] == "fp8"
    assert projection_precisions(a)[flag[2:].replace("-", "_")] == "fp8"


def test_logits_with_mxfp4_experts_as_published(tiny_mxfp4, tiny_runner, tmp_path, capsys):
    """--precision mxfp4 keeps the published experts: on the CPU the same logits as bf16 (the
    routed experts decode exactly); on several ranks it is one line of error."""
    out = tmp_path / "l.npy"
    code, _, err = run_cli(capsys, "logits", "--model", tiny_mxfp4, "--prompt-ids", "5,6,7,8", "--out", out,
                           "--precision", "mxfp4")
    assert code == 0, err
    np.testing.assert_array_equal(np.load(out), tiny_runner.prompt_logits([5, 6, 7, 8]).numpy())
    code, _, err = run_cli(capsys, "logits", "--model", tiny_mxfp4, "--prompt-ids", "5,6", "--out", tmp_path / "m.npy",
                           "--precision", "mxfp4", "--tp", "2")
    assert code == 1 and "one rank" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [["serve", "--decode-precision", "mxfp4", "--decode-tp", "2"],
                                  ["decode-worker", "--model", "MODEL", "--port", "0", "--precision", "mxfp4",
                                   "--tp", "2"]])
def test_mxfp4_experts_on_several_decode_ranks_is_one_line(argv, tiny_mxfp4, capsys):
    code, _, err = run_cli(capsys, *[tiny_mxfp4 if a == "MODEL" else a for a in argv])
    assert code == 1 and "one rank" in err and len(err.strip().splitlines()) == 1, err


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


# ---- CLI polish: imports, help, devices, ports, progress --------------------------------------
_SERVER_STACK = ("uvicorn", "fastapi", "starlette", "grpc", "pdserve.router.service",
                 "pdserve.proto.rpc", "openai_harmony")


def test_engine_commands_do_not_import_the_server_stack(tiny_mxfp4, tmp_path):
    """`pdserve logits` (and building the parser for any command) loads no web or RPC server."""
    script = (
        "import sys\n"
        "from pdserve.launch.cli import main\n"
        f"code = main(['logits', '--model', {str(tiny_mxfp4)!r}, '--prompt-ids', '1,2',"
        f" '--out', {str(tmp_path / 'l.npy')!r}])\n"
        f"print(code, sorted(m for m in {_SERVER_STACK!r} if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[-2] == "0 []", p.stdout


def _commands():
    from pdserve.launch.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices, {c.dest: c.help for c in sub._choices_actions}


def test_every_command_has_a_description_and_every_flag_help_with_its_default():
    commands, one_liners = _commands()
    assert set(commands) >= {"serve", "router", "prefill-worker", "decode-worker", "generate",
                             "logits", "make-checkpoint", "convert"}
    for name, parser in commands.items():
        assert parser.description and one_liners[name], name
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
        for action in parser._actions:
            assert action.help and action.help.strip(), f"pdserve {name} {action.option_strings or action.dest}"
    assert "add_router_args" not in one_liners["router"] and "router" not in one_liners["router"].split()[0]


@pytest.mark.parametrize("command, flag", [
    ("router", "--port"), ("router", "--grpc-port"), ("serve", "--port"), ("serve", "--grpc-port"),
    ("decode-worker", "--port"), ("prefill-worker", "--port")])
def test_a_port_in_use_is_one_line_before_anything_starts(command, flag, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = {"router": ["--port", "0", "--grpc-port", "0", "--prefill", "127.0.0.1:1",
                           "--decode", "127.0.0.1:2"],
                "serve": ["--port", "0", "--grpc-port", "0", "--log-dir", tmp_path / "logs"],
                # the model is not even looked at: the port is checked before loading it
                "decode-worker": ["--model", tmp_path / "not-loaded"],
                "prefill-worker": ["--model", tmp_path / "not-loaded"]}[command]
        p = subprocess.run([sys.executable, "-m", "pdserve.launch.cli", command, "--host", "127.0.0.1",
                            *map(str, args), flag, str(port)],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"127.0.0.1:{port}" in lines[0] and flag in lines[0] and "in use" in lines[0]
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


def test_logits_of_a_model_computed_off_the_host_or_in_bf16(monkeypatch, tmp_path, capsys):
    """The runner's logits may live on the GPU, in bf16, with autograd on: saved as float32."""
    import torch

    from pdserve.launch import cli

    expected = torch.randn(3, 11)

    class Runner:
        def prompt_logits(self, ids):
            return expected.to(torch.bfloat16).requires_grad_()
    monkeypatch.setattr(cli, "_runner", lambda a: Runner())
    out = tmp_path / "l.npy"
    code, _, err = run_cli(capsys, "logits", "--model", tmp_path, "--prompt-ids", "1,2,3", "--out", out)
    assert code == 0, err
    saved = np.load(out)
    assert saved.dtype == np.float32
    np.testing.assert_array_equal(saved, expected.to(torch.bfloat16).float().numpy())


def test_loading_a_checkpoint_shows_progress(tiny_mxfp4, tiny_cfg, capsys):
    from pdserve.engine.checkpoint import load_weights

    load_weights(tiny_mxfp4, tiny_cfg, progress=True)
    err = capsys.readouterr().err
    assert f"loading {tiny_mxfp4.name}" in err and f"{tiny_cfg.num_hidden_layers}/{tiny_cfg.num_hidden_layers}" in err
    load_weights(tiny_mxfp4, tiny_cfg)  # not a terminal: quiet
    assert capsys.readouterr().err == ""


def test_ctrl_c_in_code_compiled_from_a_string_exits_130(tmp_path):
    """Ctrl-C while start-up runs code compiled from a string (dataclasses and namedtuple build
    their methods so while modules import): the exit status is 130. CPython would end the process
    with SIGINT (-2, no message) after main() returned 130 if the interrupt had been a
    KeyboardInterrupt passing through that exec (the router's start-up did so about once in 60
    interrupts)."""
    (tmp_path / "interrupted_cli.py").write_text(
        "import sys\n"
        "from pdserve.launch import cli\n"
        "def start_up(args):\n"
        "    exec('import os, signal\\nos.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(10**7): pass')\n"
        "    return 0\n"
        "cli.cmd_convert = start_up\n"
        "sys.exit(cli.main(['convert', 'a', 'b']))\n")
    p = subprocess.run([sys.executable, "-m", "interrupted_cli"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("command", ["decode-worker", "prefill-worker", "router", "generate"])
def test_ctrl_c_during_start_up_stops_cleanly(command, tiny_mxfp4):
    """SIGINT while the command is still loading (its native libraries are being mapped): it
    stops at once, without a traceback (exit code 130, or 0 once its own signal handling runs)."""
    import signal
    import time

    args = {"decode-worker": ["--model", tiny_mxfp4, "--port", "0"],
            "prefill-worker": ["--model", tiny_mxfp4, "--port", "0"],
            "router": ["--port", "0", "--grpc-port", "0", "--prefill", "127.0.0.1:1",
                       "--decode", "127.0.0.1:2"],
            "generate": ["--model", tiny_mxfp4, "--prompt-ids", "1,2", "--max-new-tokens", "100000"]}
    loading = "cygrpc" if command == "router" else "libtorch"  # mapped once the command runs
    p = subprocess.Popen([sys.executable, "-m", "pdserve.launch.cli", command, *map(str, args[command])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        maps = f"/proc/{p.pid}/maps"
        end = time.monotonic() + 60
        while loading not in open(maps).read() and time.monotonic() < end:
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode in (0, 130), err
    assert "Traceback" not in err, err
