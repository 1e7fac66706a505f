"""pdserve: prefill/decode-disaggregated serving of gpt-oss.

One subcommand per job; `pdserve COMMAND --help` describes each. User errors are printed as one
line on stderr (exit code 1); Ctrl-C stops any command cleanly (exit code 130).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path


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

    return ModelRunner(a.model, device=a.device, precision=a.precision, prefill_chunk_tokens=a.prefill_chunk_tokens,
                       **projection_precisions(a))


def cmd_logits(a: argparse.Namespace) -> int:
    import numpy as np

    if getattr(a, "tp", 1) > 1 or getattr(a, "ep", 1) > 1:
        from pdserve.launch.parallel_logits import parallel_prompt_logits

        if a.precision == "mxfp4":
            raise CLIError("--precision mxfp4 runs on one rank: drop --tp/--ep")
        logits = parallel_prompt_logits(a.model, _parse_ids(a.prompt_ids), tp=a.tp, ep=a.ep, precision=a.precision,
                                        prefill_chunk_tokens=a.prefill_chunk_tokens, **projection_precisions(a))
    else:
        runner = _runner(a)
        # on the host, in float32, whatever device and dtype the model computed in
        logits = runner.prompt_logits(_parse_ids(a.prompt_ids)).detach().float().cpu().numpy()
    np.save(a.out, np.asarray(logits, dtype=np.float32))
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
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in --help; descriptions keep their line breaks (examples)."""


def _paragraphs(text: str) -> str:
    """Wrap each paragraph of a description; indented lines (examples) stay as they are."""
    import textwrap

    return "\n\n".join(p if p.startswith("  ") else textwrap.fill(p, 90) for p in text.split("\n\n"))


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (HF gpt-oss layout)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument("--precision", default=None, choices=["bf16", "fp8", "mxfp4"],
                   help="expert weights in compute: bf16 (the default on CPU), FP8 128x128 (the default on "
                        "CUDA) or mxfp4 (as published, one rank: the fastest single-stream decode on an H200, "
                        "slower than FP8 from a few concurrent requests)")
    add_projection_precision_args(p)
    add_prefill_chunk_arg(p)


def add_projection_precision_args(p: argparse.ArgumentParser) -> None:
    from pdserve.engine.config import PROJECTION_PRECISIONS

    p.add_argument("--attention-precision", default="bf16", choices=PROJECTION_PRECISIONS,
                   help="QKV and O projection weights: bf16, or FP8 with 128x128 block scales "
                        "(quantised at load; half the bytes a decode step reads for them)")
    p.add_argument("--unembedding-precision", default="bf16", choices=PROJECTION_PRECISIONS,
                   help="vocabulary projection (lm_head) weights: bf16, or FP8 with 128x128 block scales "
                        "(quantised at load; half of the 1.16 GB every decode step reads for them: faster "
                        "decode steps up to 8 requests, level at 16, 2%% slower at 64)")


def projection_precisions(a: argparse.Namespace) -> dict[str, str]:
    """add_projection_precision_args' flags as ModelRunner's keywords."""
    return {"attention_precision": a.attention_precision, "unembedding_precision": a.unembedding_precision}


def projection_precision_argv(a: argparse.Namespace) -> list[str]:
    """add_projection_precision_args' flags as a worker's command line takes them."""
    return ["--attention-precision", a.attention_precision, "--unembedding-precision", a.unembedding_precision]


def add_prefill_chunk_arg(p: argparse.ArgumentParser) -> None:
    from pdserve.engine.config import DEFAULT_PREFILL_CHUNK

    p.add_argument("--prefill-chunk-tokens", type=_positive_int, default=DEFAULT_PREFILL_CHUNK,
                   help="longer prompts are prefilled in forward passes of at most this many tokens, "
                        "each over the KV of the ones before (bounds activation memory)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# (name, one-line help, description, module, function adding its flags, function running it);
# the server modules are imported only to add their flags and stay light: what they serve with
# (uvicorn, FastAPI, gRPC servers, the engine) is imported when the command runs
_SERVERS = (
    ("serve", "serve gpt-oss on this machine: router, prefill and decode workers as processes",
     "Serve a local cluster until Ctrl-C: the router (OpenAI HTTP API and gRPC Generate) and the "
     "prefill and decode workers, each its own process. With no flags: the built-in tiny random "
     "model on CPU.\n\n  pdserve serve --model /models/gpt-oss-20b --device cuda "
     "--decode-workers 2",
     "pdserve.launch.serve", "add_args", "run"),
    ("router", "serve the OpenAI API in front of prefill and decode workers running elsewhere",
     "The router: OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
     "/v1/responses, /v1/models, /health, /metrics) and the token-level gRPC Generate API, in "
     "front of prefill and decode workers it finds by discovery.\n\n  pdserve router "
     "--discovery static --prefill 10.0.0.1:50061,10.0.0.2:50061 --decode 10.0.0.3:50062",
     "pdserve.router.main", "add_router_args", "run_router"),
    ("prefill-worker", "run one prefill worker (gRPC): prompts at batch size 1, KV sent to decode",
     "A prefill worker: runs each prompt at batch size 1 on its TP group and writes the KV "
     "cache straight into the decode worker's reserved blocks over NIXL.",
     "pdserve.prefill_worker.main", "add_args", "run"),
    ("decode-worker", "run one decode worker (gRPC): continuous batching, token streams",
     "A decode worker: reserves KV blocks for requests, receives their KV from prefill workers "
     "over NIXL, batches them continuously and streams the tokens back.",
     "pdserve.decode_worker.main", "add_args", "run"),
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description=__doc__, formatter_class=_HelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        description = description or help[0].upper() + help[1:] + "."
        return sub.add_parser(name, help=help, description=_paragraphs(description),
                              formatter_class=_HelpFormatter)

    p = command("make-checkpoint", "write a random checkpoint in the published HF layout")
    p.add_argument("dir", help="directory to create")
    p.add_argument("--config", required=True, help="model shape: tiny | 20b | 120b | PATH/config.json")
    p.add_argument("--seed", type=int, required=True, help="random seed of the weights")
    p.add_argument("--experts", default="mxfp4", choices=["mxfp4", "bf16"],
                   help="how the MoE experts are stored")
    p.set_defaults(fn=cmd_make_checkpoint)

    p = command("convert", "convert a checkpoint's MXFP4/bf16 experts to FP8 128x128 block-scaled")
    p.add_argument("src", help="checkpoint directory to read")
    p.add_argument("dst", help="checkpoint directory to write")
    p.set_defaults(fn=cmd_convert)

    p = command("generate", "generate from a prompt in this process (no servers)")
    _add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text (no chat template)")
    src.add_argument("--chat", help="a user message, rendered with Harmony")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    p.add_argument("--reasoning-effort", default="medium", choices=["low", "medium", "high"],
                   help="with --chat: the system message's reasoning effort")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_generate)

    p = command("logits", "save the float32 logits of every prompt position as .npy")
    _add_model_args(p)
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--out", required=True, help=".npy file to write")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo processes on CPU)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel groups (divides --tp)")
    p.set_defaults(fn=cmd_logits)

    import importlib

    for name, help, description, module, add, run in _SERVERS:
        mod = importlib.import_module(module)
        p = command(name, help, description)
        getattr(mod, add)(p)
        p.set_defaults(fn=getattr(mod, run))
    return ap


# Errors that are the user's to fix, by the module that defines them: (module, class names)
_USER_ERRORS = (
    ("pdserve.engine.checkpoint", ("CheckpointError",)),
    ("pdserve.engine.config", ("ConfigError",)),
    ("pdserve.engine.kv_cache", ("KVCacheFull",)),
    ("pdserve.engine.model_runner", ("InvalidRequest",)),
    ("pdserve.engine.sampling", ("SamplingError",)),
    ("pdserve.router.config", ("ConfigError",)),
    ("pdserve.router.harmony", ("HarmonyError",)),
    ("pdserve.proto.rpc", ("PortInUse",)),
)


def _user_errors() -> tuple[type[BaseException], ...]:
    """The user-error classes of the modules this command imported (no others can be raised:
    looking them up must not import the engine or the servers)."""
    found: list[type[BaseException]] = [CLIError, FileExistsError, FileNotFoundError]
    for module, names in _USER_ERRORS:
        if module in sys.modules:
            found += [getattr(sys.modules[module], name) for name in names]
    return tuple(found)


FORCED_EXIT_AFTER_S = 3.0
_interrupt = threading.Event()


class StartUpInterrupted(SystemExit):
    """Ctrl-C during start-up, as an exit with status 130.

    Not a KeyboardInterrupt: CPython marks a KeyboardInterrupt that passes through code compiled
    from a string (exec / eval: dataclasses and namedtuple build their methods so while modules
    import) as unhandled even when it is caught, and after a normal exit then kills the process
    with SIGINT instead of returning its status. Uncaught, a SystemExit ends the process with
    its code and no traceback; asyncio and `except Exception` let it through as they do
    KeyboardInterrupt."""

    def __init__(self) -> None:
        super().__init__(130)


def _interrupted(signum, frame) -> None:
    """Ctrl-C before a command has its own signal handling (servers install theirs once they
    can drain): StartUpInterrupted unwinds what started. Libraries busy in start-up (native code,
    tasks being cancelled) may swallow it, so the process also ends a moment later regardless;
    an error that follows it (an import cut in half) is its consequence, not news."""
    _interrupt.set()
    forced = threading.Timer(FORCED_EXIT_AFTER_S, os._exit, args=(130,))
    forced.daemon = True  # a clean exit before then does not wait for it
    forced.start()
    raise StartUpInterrupted


def main(argv: list[str] | None = None) -> int:
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.fn(args) or 0
    except (KeyboardInterrupt, StartUpInterrupted):
        return 130
    except Exception as e:
        if _interrupt.is_set():
            return 130
        if not isinstance(e, _user_errors()):
            raise
        print(f"pdserve {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
