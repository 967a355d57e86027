"""Model configuration and presets (tiny test model, Qwen2.5-0.5B/1.5B/7B, Llama-3.2-1B, Llama-3.1-8B).

The presets' shapes are their public Hugging Face ``config.json`` files' (a preset without
``model.path`` is randomly initialised: for tests, benchmarks and ``--plan``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from rljax.hf_config import ROPE_TYPES

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
#: MLP activations (``ModelConfig.hidden_act``): SwiGLU, and GeGLU with the tanh approximation (Gemma).
ACTIVATIONS = ("silu", "gelu_tanh")
#: What a rematerialised layer keeps for the backward pass (``ModelConfig.remat_policy``).
REMAT_POLICIES = ("full", "minimal")
_ROPE_TYPES = ROPE_TYPES


def _dtype_name(value: Any, field: str) -> str:
    if isinstance(value, str) and value in _DTYPES:
        return value
    try:
        name = jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in _DTYPES:
        raise ValueError(f"ModelConfig.{field} is {value!r}; accepted: {', '.join(_DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Llama/Qwen2-family decoder-only transformer.

    Frozen and hashable (it lives in the NNX graphdef). ``dtype`` is the compute dtype,
    ``param_dtype`` the storage dtype; both are ``"float32"`` or ``"bfloat16"`` (a
    ``jnp.dtype`` is accepted and stored by name). ``rope_scaling`` is ``None`` or a
    tuple of ``(key, value)`` pairs such as
    ``(("rope_type", "llama3"), ("factor", 32.0), ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))``; a dict is
    accepted and stored as sorted pairs. ``qk_norm``: an RMSNorm over each head's query and key
    before the rotary embedding (Qwen3). ``sliding_window``: the attention window of every layer
    (Mistral); sequences longer than it are refused (the model attends over the whole sequence),
    None: no window. Gemma 2 and 3: ``hidden_act="gelu_tanh"`` (GeGLU), ``norm_offset=1`` (the norms scale by
    ``1 + weight``), ``sandwich_norm`` (norms after attention and after the MLP too), ``embed_scale``
    (embeddings times ``sqrt(hidden_size)``), ``query_scale`` (scores over ``sqrt(query_scale)``
    instead of ``sqrt(head_dim)``), ``local_layers`` (a tuple of one bool per layer: the
    sliding-window layers, whose rotary base is ``rope_local_theta`` and which take no
    ``rope_scaling``; Gemma 2's are every other layer with ``rope_local_theta == rope_theta``),
    and QK-norm (Gemma 3 only). ``attn_logit_softcapping`` / ``final_logit_softcapping`` (Gemma 2:
    50 and 30; None: none): the attention scores and the output logits become ``cap * tanh(x / cap)``,
    in every attention path and wherever logits or log-probs are computed (the fused log-prob's
    Pallas kernels refuse a final cap in one line; ``impl="auto"`` then takes the chunked path). ``remat`` rematerialises each layer in the
    backward pass, keeping (``remat_policy``) only the layer's input (``full``) or also the
    projections' outputs (``minimal``, MaxText's name: the norms, activations and attention are
    recomputed). ``scan_layers``: the layers run as one ``jax.lax.scan`` body (compile
    time independent of depth); ``False`` unrolls them (no stacked per-layer residual buffers
    in the backward pass: 25% fewer update temporaries at 31.6M, see the README). ``attn_block_size``: attention over more keys than this runs blockwise
    (flash-style, never materialising ``[T, T]`` scores); ``None`` always uses dense.
    ``decode_block_size``: the KV-cache block of live-length decode attention (a decode
    step reads the cache up to the longest live slot, rounded up to this, or with the engine's
    per-layer cache up to ``decode_block_size // 8``; that cache copies each block it reads,
    and reads the whole cache in place once the live blocks reach half of it). 64: 0.89x the sampler's time of 256 at 31.6M, 8 x 8,
    256 tokens, one core, same tokens.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    sandwich_norm: bool = False
    embed_scale: bool = False
    query_scale: float | None = None
    local_layers: Any = None
    rope_local_theta: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: Any = "float32"
    param_dtype: Any = "float32"
    remat: bool = False
    remat_policy: str = "full"
    scan_layers: bool = True
    attn_block_size: int | None = 512
    decode_block_size: int = 64
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} is {v!r}; it must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"ModelConfig.hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); set head_dim"
                )
            head_dim = self.hidden_size // self.num_heads
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim is {head_dim}; it must be a positive even integer (rotary embedding)")
        object.__setattr__(self, "head_dim", int(head_dim))
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype, "param_dtype"))
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat_policy is {self.remat_policy!r}; accepted: {', '.join(REMAT_POLICIES)}")
        if self.architecture not in _ARCHS:
            raise ValueError(f"ModelConfig.architecture is {self.architecture!r}; accepted: {', '.join(_ARCHS)}")
        scaling = self.rope_scaling
        if isinstance(scaling, dict):
            scaling = tuple(sorted(scaling.items()))
            object.__setattr__(self, "rope_scaling", scaling)
        if scaling is not None:
            rope_type = dict(scaling).get("rope_type", dict(scaling).get("type", "default"))
            if rope_type not in _ROPE_TYPES:
                raise ValueError(f"ModelConfig.rope_scaling type {rope_type!r} is not supported; accepted: {', '.join(_ROPE_TYPES)}")
        b = self.attn_block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ValueError(f"ModelConfig.attn_block_size is {b!r}; it must be a positive integer or None")
        d = self.decode_block_size
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise ValueError(f"ModelConfig.decode_block_size is {d!r}; it must be a positive integer")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.hidden_act is {self.hidden_act!r}; accepted: {', '.join(ACTIVATIONS)}")
        if self.local_layers is not None:
            object.__setattr__(self, "local_layers", tuple(bool(x) for x in self.local_layers))
            if len(self.local_layers) != self.num_layers or self.rope_local_theta is None:
                raise ValueError("ModelConfig.local_layers needs one entry per layer and rope_local_theta")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None:
                if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf"):
                    raise ValueError(f"ModelConfig.{name} is {cap!r}; accepted: None or a positive number")
                object.__setattr__(self, name, float(cap))
                if self.architecture not in ("gemma2", "gemma3"):  # the config.json keys only Gemma's export carries
                    raise ValueError(f"ModelConfig.{name}={cap} needs architecture 'gemma2' or 'gemma3' (whose "
                                     f"config.json carries it), not {self.architecture!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ValueError(f"ModelConfig.sliding_window is {w!r}; it must be a positive integer or None")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta is {self.rope_theta}; it must be positive")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        if self.sandwich_norm:
            attn += 2 * h
        layer = attn + 3 * h * f + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embed + h


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelConfig] = {
    # Tests and the CPU default run: GQA, QKV bias, untied; sizes divide tp/sp up to 4.
    "tiny": ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=False,
        max_position_embeddings=512, architecture="qwen2",
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
        max_position_embeddings=32768, dtype="bfloat16", param_dtype="bfloat16", architecture="qwen2",
        bos_token_id=151643, eos_token_id=151643,
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
        head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
        max_position_embeddings=131072, dtype="bfloat16", param_dtype="bfloat16", architecture="qwen2",
        bos_token_id=151643, eos_token_id=151643,
    ),
    # Qwen/Qwen2.5-7B config.json: 28 layers, q 28 x 128 / kv 4 x 128, untied 152064-token vocabulary (7.6B)
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=False,
        max_position_embeddings=131072, dtype="bfloat16", param_dtype="bfloat16", architecture="qwen2",
        bos_token_id=151643, eos_token_id=151643,
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, rms_norm_eps=1e-5, qkv_bias=False,
        tie_embeddings=True, max_position_embeddings=131072, dtype="bfloat16", param_dtype="bfloat16",
        architecture="llama", bos_token_id=128000, eos_token_id=128001,
    ),
    # meta-llama/Llama-3.1-8B config.json: 32 layers, q 32 x 128 / kv 8 x 128, llama3 rope scaling x8, untied (8.0B)
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rope_theta=500000.0, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}, rms_norm_eps=1e-5,
        qkv_bias=False, tie_embeddings=False, max_position_embeddings=131072, dtype="bfloat16",
        param_dtype="bfloat16", architecture="llama", bos_token_id=128000, eos_token_id=128001,
    ),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name (``tiny``, ``qwen2.5-0.5b``, ``qwen2.5-1.5b``, ``qwen2.5-7b``, ``llama-3.2-1b``,
    ``llama-3.1-8b``) with field overrides."""
    key = name.lower().replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; accepted: {', '.join(PRESETS)}")
    return PRESETS[key].replace(**overrides) if overrides else PRESETS[key]
