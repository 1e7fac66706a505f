"""bench/hf_tokenizer.py: the Hugging Face tokenizer it writes encodes exactly as the server."""


from tokenizers import Tokenizer

from pdserve.bench.hf_tokenizer import build
from router_harness import codec

_ALPHABET = "abcXYZ019 .,;:!?'\"()[]{}<>/\\_-+=*&^%$#@~`\t\n\r  äöüßéñ東京大阪🙂🌧\u0301"


def test_hf_tokenizer_matches_the_server_encoding(tmp_path, rng):
    tokenizer = Tokenizer.from_file(str(build(tmp_path) / "tokenizer.json"))
    for _ in range(100):
        text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 200)))
        assert tokenizer.encode(text, add_special_tokens=False).ids == codec().encode(text), text
    harmony = "<|start|>assistant<|channel|>final<|message|>hi<|return|>"
    assert tokenizer.encode(harmony).ids == codec().encode(harmony, special_tokens=True)
    assert tokenizer.get_vocab_size() == codec().encoding_size
