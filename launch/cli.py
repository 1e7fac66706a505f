"""`pdserve` command line: one subcommand per job, errors as one line on stderr."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

EXIT_USAGE = 2


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit code 1."""


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise CLIError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise CLIError("--prompt-ids is empty")
    return ids


def _config_arg(value: str):
    from pdserve.engine.config import ModelConfig, preset

    if value in ("tiny", "20b", "120b"):
        return preset(value)
    return ModelConfig.load(Path(value).parent if value.endswith(".json") else value)


# -- subcommands --------------------------------------------------------------------------------
def cmd_make_checkpoint(a: argparse.Namespace) -> int:
    from pdserve.engine.checkpoint_writer import make_random_checkpoint

    cfg = _config_arg(a.config)
    out = make_random_checkpoint(a.dir, cfg, seed=a.seed, experts=a.experts, progress=sys.stderr.isatty())
    print(f"wrote a random {a.experts} checkpoint ({cfg.num_hidden_layers} layers, "
          f"{cfg.num_local_experts} experts, vocab {cfg.vocab_size}) to {out}")
    return 0


def cmd_convert(a: argparse.Namespace) -> int:
    from pdserve.engine.checkpoint_writer import convert_checkpoint

    stats = convert_checkpoint(a.src, a.dst, progress=True)
    frac = stats["exact_blocks"] / max(1, stats["blocks"])
    print(f"wrote FP8 checkpoint to {a.dst}: {stats['exact_blocks']}/{stats['blocks']} expert "
          f"blocks ({frac:.1%}) bit-exact with power-of-two scales")
    return 0


def _runner(a: argparse.Namespace):
    from pdserve.engine.model_runner import ModelRunner

    return ModelRunner(a.model, device=a.device, precision=a.precision)


def cmd_logits(a: argparse.Namespace) -> int:
    import numpy as np

    if getattr(a, "tp", 1) > 1 or getattr(a, "ep", 1) > 1:
        from pdserve.launch.parallel_logits import parallel_prompt_logits

        logits = parallel_prompt_logits(a.model, _parse_ids(a.prompt_ids), tp=a.tp, ep=a.ep, precision=a.precision)
    else:
        runner = _runner(a)
        logits = runner.prompt_logits(_parse_ids(a.prompt_ids)).numpy()
    np.save(a.out, logits.astype(np.float32))
    print(f"saved float32 logits {tuple(logits.shape)} to {a.out}")
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    codec = None
    if a.prompt_ids is not None:
        ids = _parse_ids(a.prompt_ids)
    else:
        from pdserve.router.harmony import HarmonyCodec

        codec = HarmonyCodec()
        if a.chat is not None:
            ids = codec.render_chat([{"role": "user", "content": a.chat}], reasoning_effort=a.reasoning_effort)
        else:
            ids = codec.encode(a.prompt)
    runner = _runner(a)
    stop = codec.stop_token_ids() if (codec and a.chat is not None) else []
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                            max_new_tokens=a.max_new_tokens, stop_token_ids=stop)
    result = LLMEngine(runner).generate([ids], params)[0]
    out = {"prompt_tokens": len(ids), "completion_tokens": len(result.output_ids),
           "output_ids": result.output_ids, "finish_reason": result.finish_reason.value}
    if a.chat is not None:
        parsed = codec.parse_completion(result.output_ids)
        out.update(content=parsed.content, reasoning_content=parsed.reasoning_content,
                   tool_calls=[vars(t) for t in parsed.tool_calls])
    elif codec is not None:
        out["text"] = codec.decode(result.output_ids)
    if a.json:
        print(json.dumps(out, ensure_ascii=False))
    elif a.chat is not None:
        if out["reasoning_content"]:
            print(f"[reasoning] {out['reasoning_content']}")
        for t in out["tool_calls"]:
            print(f"[tool call] {t['name']}({t['arguments']})")
        print(f"[assistant] {out['content']}")
        print(f"[finish] {out['finish_reason']} after {out['completion_tokens']} tokens")
    elif "text" in out:
        print(out["text"])
    else:
        print(",".join(map(str, result.output_ids)))
    return 0


# -- parser -------------------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (HF gpt-oss layout)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default=None, choices=["bf16", "fp8"],
                   help="expert weights in compute: bf16 (default on CPU) or fp8 128x128 (default on CUDA)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-checkpoint", help="write a random checkpoint in the real HF layout")
    p.add_argument("dir")
    p.add_argument("--config", required=True, help="tiny | 20b | 120b | PATH/config.json")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--experts", default="mxfp4", choices=["mxfp4", "bf16"])
    p.set_defaults(fn=cmd_make_checkpoint)

    p = sub.add_parser("convert", help="convert MXFP4/bf16 experts to FP8 128x128 block-scaled")
    p.add_argument("src")
    p.add_argument("dst")
    p.set_defaults(fn=cmd_convert)

    p = sub.add_parser("generate", help="generate from a prompt in this process")
    _add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text (no chat template)")
    src.add_argument("--chat", help="a user message, rendered with Harmony")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--reasoning-effort", default="medium", choices=["low", "medium", "high"])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("logits", help="float32 logits of every prompt position, saved as .npy")
    _add_model_args(p)
    p.add_argument("--prompt-ids", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo processes on CPU)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel groups (divides --tp)")
    p.set_defaults(fn=cmd_logits)

    servers = (("serve", "pdserve.launch.serve", "add_args", "run"),
               ("router", "pdserve.router.main", "add_router_args", "run_router"),
               ("prefill-worker", "pdserve.prefill_worker.main", "add_args", "run"),
               ("decode-worker", "pdserve.decode_worker.main", "add_args", "run"))
    for name, module, add, run in servers:
        _add_server(sub, name, module, add, run)
    return ap


def _add_server(sub, name: str, module: str, add: str, run: str) -> None:
    """Server subcommands take their flags from their own package."""
    import importlib

    mod = importlib.import_module(module)
    doc = (mod.__doc__ or "").strip().splitlines()
    p = sub.add_parser(name, help=doc[0] if doc else None)
    getattr(mod, add)(p)
    p.set_defaults(fn=getattr(mod, run))


def main(argv: list[str] | None = None) -> int:
    from pdserve.engine.checkpoint import CheckpointError
    from pdserve.engine.config import ConfigError
    from pdserve.engine.kv_cache import KVCacheFull
    from pdserve.engine.model_runner import InvalidRequest
    from pdserve.engine.sampling import SamplingError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    user_errors = (CLIError, ConfigError, CheckpointError, InvalidRequest, SamplingError, KVCacheFull,
                   FileExistsError, FileNotFoundError)
    try:
        from pdserve.router.harmony import HarmonyError

        user_errors += (HarmonyError,)
    except ImportError:
        pass
    try:
        return args.fn(args)
    except user_errors as e:
        print(f"pdserve {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
