"""Write a Hugging Face tokenizer directory for gpt-oss's encoding (o200k_harmony), offline.

Benchmark clients (guidellm, aiperf) count and synthesise prompts with a Hugging Face tokenizer.
Real checkpoints ship one (`tokenizer.json` beside the weights); the built-in tiny model does not.
This builds it from the vocabulary pdserve already has offline (the o200k_base ranks plus the
Harmony special tokens at their ids), so the ids match the server's exactly:

    python -m pdserve.bench.hf_tokenizer /tmp/gpt-oss-tokenizer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pdserve.engine.vocab import O200K_PATTERN, token_bytes
from pdserve.router.harmony import HarmonyCodec

def build(out_dir: Path) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`; return it."""
    codec = HarmonyCodec()
    ranks = token_bytes()
    if sorted(ranks.values()) != list(range(codec.first_special_id)):
        raise SystemExit("the vocabulary's ranks do not end where the special tokens start")
    # the byte-level alphabet HF's BPE works in: each byte one printable character
    table = bytes_to_unicode()
    texts = {token: token.decode("latin-1").translate(table) for token in ranks}
    merges = []  # a token's merges: every split into two known pieces, in the order of its rank
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        if len(pairs) > 1:
            pairs.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((rank, left, right) for left, right in pairs)
    merges.sort(key=lambda merge: merge[0])
    tokenizer = Tokenizer(BPE({texts[t]: rank for t, rank in ranks.items()},
                              [(texts[a], texts[b]) for _, a, b in merges], fuse_unk=False,
                              ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [codec.decode([i]) for i in range(codec.first_special_id, codec.encoding_size)]
    tokenizer.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "model_max_length": 131072}, indent=1))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the tokenizer into")
    print(build(parser.parse_args(argv).out_dir))


if __name__ == "__main__":
    main()
