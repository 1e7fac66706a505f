"""Structured outputs: a sequence's grammar over token ids, run by llguidance.

The router writes the grammar (llguidance's Lark dialect, where special tokens such as
`<|channel|>` are terminals and `%json{...}` embeds a JSON schema); the workers only compile and
run it, so they know nothing of chat formats. A `Matcher` fills the sequence's row of the sampler's
token bitmask (`sampling.apply_token_bitmask`) and follows each accepted token.

Every output must parse, also when the model wanders (random weights never close a JSON string
on their own) or `max_tokens` is short: the matcher keeps the token budget in view. It computes
the *way out*, the shortest completion it can find from where the sequence stands (a special token
such as `<|end|>` when one is allowed, else a closing quote, brace or bracket, a zero, else the
longest allowed token), and once the budget left is no more than that path plus `MARGIN`, it
forces the path one token at a time (a mask with one bit). The way out is recomputed only as often
as the budget requires: a token can lengthen it by at most about `GROWTH` tokens.
"""

from __future__ import annotations

import os
from functools import lru_cache

import llguidance as llg
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from .config import VOCAB_SIZE
from .sampling import SamplingError, SamplingParams
from .vocab import O200K_PATTERN, special_tokens, token_bytes

MASK_WORDS = (VOCAB_SIZE + 31) // 32  # int32 words of one bitmask row
MARGIN = 8  # budget kept beyond the way out before it is forced
GROWTH = 8  # how much one free token may lengthen the way out (nesting, a required key...)
_CLOSERS = (b"}", b"]", b'"', b",", b":", b"0")  # preferred on the way out, in this order
_LETTERS = (b"a", b"x")  # allowed inside a free string, never in JSON outside one
_LOOKAHEAD_LIMIT = 64  # longest way out followed to compare alternatives
_FREE_TEXT_TOKENS = 150_000  # a mask allowing this many tokens is free text (a string, the analysis)
_LOOKAHEAD_ALLOWED = 16  # compared only where this few tokens are allowed (literals, not free text)
_LOOKAHEAD = 4  # alternatives compared where a few literals are allowed (a channel name, an enum)
_END_OF_GRAMMAR = "<|endoftext|>"  # llguidance's EOS: grammars end in explicit end tokens instead


class GrammarError(SamplingError):
    """The grammar does not compile, or a token it cannot accept was forced on it."""


@lru_cache(maxsize=1)
def tokenizer() -> llg.LLTokenizer:
    """The vocabulary as llguidance sees it (a few seconds to build, once per process, on the first
    request with a grammar)."""
    specials = special_tokens(VOCAB_SIZE)
    return llg.LLTokenizer.from_tiktoken(encoder=token_bytes(), special_tokens=specials,
                                         pattern=O200K_PATTERN, eos_token=specials[_END_OF_GRAMMAR],
                                         n_vocab=VOCAB_SIZE)


@lru_cache(maxsize=1)
def _token_lengths() -> np.ndarray:
    lengths = np.zeros(VOCAB_SIZE, dtype=np.int32)
    for text, i in token_bytes().items():
        lengths[i] = len(text)
    return lengths


@lru_cache(maxsize=1)
def _text_only() -> np.ndarray:
    """bool [V]: ordinary tokens of whole UTF-8 characters without a quote or backslash: text that
    never leaves a JSON string or the analysis, nor stops inside a character."""
    safe = np.zeros(VOCAB_SIZE, dtype=bool)
    for text, i in token_bytes().items():
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            continue
        safe[i] = b'"' not in text and b"\\" not in text
    return safe


@lru_cache(maxsize=1)
def _ids_of(texts: tuple[bytes, ...]) -> tuple[int, ...]:
    ids = token_bytes()
    return tuple(ids[t] for t in texts)


def _has(row: np.ndarray, token: int) -> bool:
    return bool(row.view(np.uint32)[token >> 5] >> (token & 31) & 1)


def _choose(m: llg.LLMatcher, row: np.ndarray, limit: int, lookahead: bool) -> int | None:
    """The next token of the way out (None: nothing is allowed): a special token (the grammar's
    structure), else the first allowed closer (a quote first inside a string, where braces are
    text), else the longest allowed token or, with `lookahead` where only a few are allowed (a
    channel name), the one of the few longest whose own way out is shortest."""
    first_special = len(token_bytes())
    special = allowed(row, start=first_special)
    if len(special):
        return int(special[0])
    quote = token_bytes()[b'"']
    if _has(row, quote) and any(_has(row, t) for t in _ids_of(_LETTERS)):
        return quote
    for c in _ids_of(_CLOSERS):
        if _has(row, c):
            return c
    ids = allowed(row)
    if not len(ids):
        return None
    few = lookahead and len(ids) <= _LOOKAHEAD_ALLOWED
    longest = ids[np.argsort(-_token_lengths()[ids], kind="stable")[:_LOOKAHEAD if few else 1]]
    if len(longest) == 1:
        return int(longest[0])

    def cost(token: int) -> int:  # an unfinished way out counts as longer than any finished one
        c = m.deep_copy()
        if not c.consume_token(token):
            return 2 * _LOOKAHEAD_LIMIT + 2
        path = _greedy(c, _LOOKAHEAD_LIMIT, lookahead=False)
        return len(path) if c.is_accepting() else _LOOKAHEAD_LIMIT + 1 + len(path)
    return int(min(longest, key=cost))


def _greedy(m: llg.LLMatcher, limit: int, lookahead: bool) -> list[int]:
    """Walk `m` (moved: pass a copy) along the way out until its grammar accepts; the tokens.
    Alternatives are compared (`lookahead`) only right after a special token: where a header names
    its channel."""
    row, path = np.empty((1, MASK_WORDS), dtype=np.int32), []
    first_special = len(token_bytes())
    while not m.is_accepting() and len(path) < limit:
        fill_next_token_bitmask(m, row)
        token = _choose(m, row[0], limit - len(path), lookahead and bool(path) and path[-1] >= first_special)
        if token is None or not m.consume_token(token):
            break
        path.append(token)
    return path


def check(grammar: str) -> None:
    """Raise GrammarError with llguidance's message when `grammar` does not compile."""
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer())
    if error:
        raise GrammarError(f"grammar does not compile: {error}")


def allowed(row: np.ndarray, start: int = 0) -> np.ndarray:
    """Token ids >= start whose bit is set in one bitmask row (cheap where few words are set)."""
    first = start >> 5
    words = np.flatnonzero(row[first:]) + first
    bits = np.unpackbits(row[words].view(np.uint8), bitorder="little").reshape(-1, 32).astype(bool)
    ids = (words[:, None] * 32 + np.arange(32))[bits]
    return ids[(ids >= start) & (ids < VOCAB_SIZE)]


def _one_hot(row: np.ndarray, token: int) -> None:
    row[:] = 0
    row.view(np.uint32)[token >> 5] = np.uint32(1 << (token & 31))


_initial_paths: dict[str, list[int]] = {}


def _initial_way_out(grammar: str, m: llg.LLMatcher) -> list[int]:
    path = _initial_paths.get(grammar)
    if path is None:
        path = _greedy(m.deep_copy(), _LOOKAHEAD_LIMIT * 4, lookahead=True)
        if len(_initial_paths) >= 256:
            _initial_paths.pop(next(iter(_initial_paths)))
        _initial_paths[grammar] = path
    return path


class Matcher:
    """One sequence's place in its grammar and the budget it has left.

    grammar : llguidance grammar text. max_new_tokens : the sequence's budget. generated : the
    tokens it already produced (a migrated stream, or the first token from the prefill worker).
    """

    def __init__(self, grammar: str, max_new_tokens: int, generated: list[int] | tuple = ()):
        self._m = llg.LLMatcher(tokenizer(), grammar)
        if self._m.is_error():
            raise GrammarError(f"grammar does not compile: {self._m.get_error()}")
        self.max_new_tokens = max_new_tokens
        self.num_generated = 0
        self._forced: list[int] = []  # the way out, once the budget forces it
        # the last way out measured, while still valid: text inside a string or the analysis
        # (`_in_text`) does not move it, so the budget is then checked every step for free
        self._path: list[int] | None = None
        self._in_text = False
        # the way out of the start is the same for every request of a grammar: measured once
        first = _initial_way_out(grammar, self._m)
        self._check_at = max(0, (max_new_tokens - len(first) - MARGIN) // (1 + GROWTH))
        for token in generated:
            self.accept(token)

    @property
    def forced(self) -> bool:
        return bool(self._forced)

    def done(self) -> bool:
        return self._m.is_accepting() or self._m.is_stopped()

    def way_out(self, limit: int) -> list[int]:
        """The shortest completion found from here (at most `limit` tokens), without moving."""
        return _greedy(self._m.deep_copy(), limit, lookahead=True)

    def needs_free_mask(self) -> bool:
        """Decide whether this step is forced (True: the grammar's own mask is wanted)."""
        remaining = self.max_new_tokens - self.num_generated
        if self._forced:
            return False
        fresh = self._path is None and self.num_generated >= self._check_at
        if fresh:
            self._path = self.way_out(remaining)
            row = np.empty((1, MASK_WORDS), dtype=np.int32)
            fill_next_token_bitmask(self._m, row)
            self._in_text = int(np.bitwise_count(row.view(np.uint32)).sum()) >= _FREE_TEXT_TOKENS
        if self._path is not None:
            slack = remaining - len(self._path) - MARGIN
            if slack < 1 + GROWTH:  # the next check would be too late: out now
                self._forced = list(self._path)
            elif fresh:
                self._check_at = self.num_generated + slack // (1 + GROWTH)
        return not self._forced

    def fill_forced(self, row: np.ndarray) -> None:
        _one_hot(row, self._forced[0])

    def fill(self, row: np.ndarray) -> None:
        """This step's allowed tokens into `row` (int32 [MASK_WORDS])."""
        if self.needs_free_mask():
            fill_next_token_bitmask(self._m, row[None], 0)
        else:
            self.fill_forced(row)

    def accept(self, token: int) -> None:
        if self._forced:
            if token != self._forced[0]:
                raise GrammarError(f"token {token} left the forced way out (expected {self._forced[0]})")
            self._forced.pop(0)
        if not self._m.consume_token(token):
            raise GrammarError(f"token {token} is not allowed by the grammar: {self._m.get_error()}")
        self.num_generated += 1
        if self._path is not None and not (self._in_text and _text_only()[token]):
            self._path = None  # the way out moved: measured again when the schedule says


def matcher_for(params: SamplingParams, generated: list[int]) -> Matcher | None:
    """A fresh matcher that has followed `generated`, or None when the request is free.
    Raises GrammarError (a ValueError) when the grammar does not compile or rejects a token."""
    return Matcher(params.grammar, params.max_new_tokens, generated) if params.grammar else None


_executor: llg.LLExecutor | None = None
_PARALLEL = (os.cpu_count() or 1) >= 8


def fill_masks(matchers: list[Matcher | None]) -> np.ndarray | None:
    """The batch's token bitmask: int32 [B, MASK_WORDS], all ones for rows without a grammar;
    None when no row has one. Free rows are filled in parallel by llguidance's thread pool on a
    host with the cores for it (on a few, the pool costs more than it saves: docs/performance.md)."""
    global _executor
    if all(m is None for m in matchers):
        return None
    mask = np.full((len(matchers), MASK_WORDS), -1, dtype=np.int32)
    free = []
    for i, m in enumerate(matchers):
        if m is None:
            continue
        if m.needs_free_mask():
            free.append((m._m, i))
        else:
            m.fill_forced(mask[i])
    if len(free) > 1 and _PARALLEL:
        if _executor is None:
            _executor = llg.LLExecutor()
        fill_next_token_bitmask_par(_executor, free, mask)
    else:
        for m, i in free:
            fill_next_token_bitmask(m, mask, i)
    return mask
