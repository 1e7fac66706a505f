"""Model configuration, read from a checkpoint's HF `config.json`.

Every architectural number the forward pass uses lives here, so a config that the engine cannot
serve is rejected once, with a message, instead of failing somewhere inside a matmul.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

VOCAB_SIZE = 201088  # o200k_harmony: every Harmony token id is valid in every preset


class ConfigError(ValueError):
    """The checkpoint's config.json is missing, malformed or describes a model we do not serve."""


# tokens per prefill forward pass (ModelRunner): at 8192 the 20b/120b activations (the MoE's routed
# copies and expert intermediates, attention's per-chunk buffers) stay a few GiB on an H200, and
# the GEMMs already run at their large-M rate (docs/engine.md, chunked prefill)
DEFAULT_PREFILL_CHUNK = 8192
# what the dense projections' weights may be held in (--attention-precision, --unembedding-precision):
# as loaded, or FP8 with 128x128 block scales quantised at load
PROJECTION_PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 32
    experts_per_token: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling_factor: float = 32.0
    rope_ntk_alpha: float = 1.0  # beta_slow
    rope_ntk_beta: float = 32.0  # beta_fast
    initial_context_length: int = 4096
    max_position_embeddings: int = 131072
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    eos_token_ids: tuple[int, ...] = (200002, 200012)
    pad_token_id: int = 199999
    experts_format: str = "mxfp4"  # how the checkpoint stores experts: mxfp4 | bf16 | fp8
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            types = tuple(
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", types)
        problems = []
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        bad = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if bad:
            problems.append(f"unknown layer types {sorted(bad)}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            problems.append("head_dim must be even (half-split rotary)")
        if self.experts_per_token > self.num_local_experts:
            problems.append("experts_per_token exceeds num_local_experts")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % 32:
                problems.append(f"{name} must be a multiple of 32 (MXFP4 groups)")
        if self.experts_format not in ("mxfp4", "bf16", "fp8"):
            problems.append(f"unknown experts format {self.experts_format!r}")
        if problems:
            raise ConfigError("unsupported model config: " + "; ".join(problems))

    # -- derived -------------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int:
        """Keys visible to a query, itself included (0 = unbounded)."""
        return self.sliding_window if self.is_sliding(layer) else 0

    # -- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        if d.get("model_type") not in (None, "gpt_oss"):
            raise ConfigError(f"model_type {d.get('model_type')!r} is not gpt_oss")
        try:
            rope = d.get("rope_scaling") or {}
            if rope and rope.get("rope_type", rope.get("type", "yarn")) != "yarn":
                raise ConfigError(f"rope_scaling type {rope.get('rope_type')!r} is not yarn")
            eos = d.get("eos_token_id", [200002, 200012])
            eos = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
            quant = d.get("quantization_config") or {}
            if quant.get("quant_method") == "mxfp4":
                fmt = "mxfp4"
            elif quant.get("quant_method") == "pdserve_fp8_block":
                fmt = "fp8"
            elif not quant:
                fmt = "bf16"
            else:
                raise ConfigError(f"quantization {quant.get('quant_method')!r} is not supported")
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d["num_key_value_heads"]),
                head_dim=int(d.get("head_dim", 64)),
                num_local_experts=int(d["num_local_experts"]),
                experts_per_token=int(d.get("num_experts_per_tok", d.get("experts_per_token", 4))),
                sliding_window=int(d.get("sliding_window") or 0),
                layer_types=tuple(d.get("layer_types") or ()),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(d.get("rope_theta", 150000)),
                rope_scaling_factor=float(rope.get("factor", 1.0)),
                rope_ntk_alpha=float(rope.get("beta_slow", 1.0)),
                rope_ntk_beta=float(rope.get("beta_fast", 32.0)),
                initial_context_length=int(
                    rope.get("original_max_position_embeddings", d.get("initial_context_length", 4096))
                ),
                max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
                swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                eos_token_ids=eos,
                pad_token_id=int(d.get("pad_token_id", 199999)),
                experts_format=fmt,
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config.json has a malformed field: {e}") from None

    def to_hf_dict(self) -> dict:
        d = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": True,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.9,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.experts_per_token,
            "experts_per_token": self.experts_per_token,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": self.rope_scaling_factor,
                "beta_fast": self.rope_ntk_beta,
                "beta_slow": self.rope_ntk_alpha,
                "original_max_position_embeddings": self.initial_context_length,
                "truncate": False,
            },
            "initial_context_length": self.initial_context_length,
            "max_position_embeddings": self.max_position_embeddings,
            "swiglu_limit": self.swiglu_limit,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
        }
        if self.experts_format == "mxfp4":
            d["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
            }
        elif self.experts_format == "fp8":
            d["quantization_config"] = {
                "quant_method": "pdserve_fp8_block",
                "weight_block_size": [128, 128],
                "fmt": "e4m3",
            }
        return d

    def with_experts_format(self, fmt: str) -> "ModelConfig":
        d = asdict(self)
        d["experts_format"] = fmt
        return ModelConfig(**d)

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: is {model_dir} a gpt-oss checkpoint directory?")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return cls.from_hf_dict(d)


def preset(name: str) -> ModelConfig:
    """Built-in shapes: the two published models and `tiny` for CPU tests.

    `tiny` keeps the full vocabulary (so Harmony's special tokens are valid ids), a hidden size that
    is not a multiple of 128 (so FP8 block padding is exercised), 4 KV heads (TP up to 4) and a
    16-token sliding window (so short test prompts cross it).
    """
    if name == "20b":
        return ModelConfig()
    if name == "120b":
        return ModelConfig(num_hidden_layers=36, num_local_experts=128)
    if name == "tiny":
        return ModelConfig(
            hidden_size=160,
            intermediate_size=160,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            num_local_experts=8,
            experts_per_token=4,
            sliding_window=16,
            max_position_embeddings=4096,
        )
    raise ConfigError(f"unknown preset {name!r} (choose tiny, 20b or 120b)")
