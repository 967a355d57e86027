"""What rljax reads from a Hugging Face ``config.json``: the supported architectures and options.

Pure Python (no JAX), so the launcher's preflight refuses an unsupported checkpoint in one
line before anything is written, with the same reasons :func:`rljax.models.load_hf_checkpoint`
gives. :func:`model_fields` turns a parsed ``config.json`` into the fields of
:class:`rljax.models.ModelConfig`, or raises ``ValueError`` naming what is not supported.
"""

from __future__ import annotations

#: HF ``architectures[0]`` -> rljax's family name (``ModelConfig.architecture``).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
#: HF activation names -> ``ModelConfig.hidden_act``.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
#: Rotary scalings the model computes (``ModelConfig.rope_scaling``'s ``rope_type``).
ROPE_TYPES = ("default", "linear", "llama3")
_SCALING_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def architecture_of(cfg: dict) -> str:
    """rljax's family of a parsed ``config.json``, or ValueError naming the supported ones."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} (model_type {cfg.get('model_type')!r}); "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return SUPPORTED_ARCHITECTURES[arch]


def _rope_scaling(cfg: dict):
    rope_params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or rope_params or None
    if not scaling:
        return None
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported config.json: rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    scaling = {k: v for k, v in scaling.items() if k in _SCALING_KEYS}
    return None if scaling.get("rope_type", "default") == "default" else scaling


def _sliding_window(cfg: dict, family: str):
    """The attention window every layer uses (None: full attention), or ValueError."""
    if family in ("qwen2", "qwen3"):
        if cfg.get("use_sliding_window"):
            raise ValueError(f"unsupported config.json: {family.capitalize()} use_sliding_window=true (sliding-window "
                             "attention on some layers) is not supported")
        return None
    if family in ("mistral", "gemma2", "gemma3"):
        window = cfg.get("sliding_window")
        return None if window is None or window >= int(cfg.get("max_position_embeddings", 4096)) else int(window)
    return None


#: Gemma's soft-capping keys (``cap * tanh(x / cap)`` of the attention scores and of the output logits;
#: a real Gemma 2 checkpoint sets 50 and 30), carried into ``ModelConfig`` under the same names.
SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")


def _softcapping(cfg: dict, name: str) -> dict:
    out = {}
    for key in SOFTCAP_KEYS:
        cap = cfg.get(key)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf")):
            raise ValueError(f"unsupported config.json: {name} {key}={cap!r}; accepted: null or a positive number")
        out[key] = None if cap is None else float(cap)
    return out


def _gemma(cfg: dict, family: str) -> dict:
    """Gemma 2's and 3's fields: the norm offset, sandwich norms, scaled embeddings, the query scale,
    the soft-capping of the attention scores and output logits,
    its sliding-window layers (Gemma 2: every other one from the first, the same rotary base; Gemma 3:
    their own rotary base; transformers 4's rope_local_base_freq / sliding_window_pattern, or 5's
    rope_parameters / layer_types), and QK-norm (Gemma 3)."""
    name = "Gemma 2" if family == "gemma2" else "Gemma 3"
    caps = _softcapping(cfg, name)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"unsupported config.json: {name} use_bidirectional_attention=true (a causal LM is needed)")
    n = cfg["num_hidden_layers"]
    every = 2 if family == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    params = dict(cfg.get("rope_parameters") or {})
    if family == "gemma2":  # one rotary embedding for every layer
        params = {"full_attention": params, "sliding_attention": params} if params else {}
    local = dict(params.get("sliding_attention") or {})
    full = dict(params.get("full_attention") or {})
    default_theta = 10000.0 if family == "gemma2" else 1000000.0
    theta = full.get("rope_theta", cfg.get("rope_theta", default_theta))
    local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", theta if family == "gemma2" else 10000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported config.json: {name} sliding-window rope_type {local['rope_type']!r}")
    scaling = dict(full) if full else cfg.get("rope_scaling")
    return dict(hidden_act_hf=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
                theta=theta, scaling=scaling,
                extra=dict(norm_offset=1.0, sandwich_norm=True, embed_scale=True, qk_norm=family == "gemma3",
                           query_scale=cfg.get("query_pre_attn_scalar", 256),
                           local_layers=tuple(t == "sliding_attention" for t in types),
                           rope_local_theta=float(local_theta), **caps))


def model_fields(cfg: dict, *, dtype=None) -> dict:
    """The keyword arguments of ``ModelConfig`` for a parsed HF ``config.json`` dict.

    Raises:
      ValueError: one line naming the unsupported architecture or option.
    """
    family = architecture_of(cfg)
    gemma = _gemma(cfg, family) if family in ("gemma2", "gemma3") else None
    act = gemma["hidden_act_hf"] if gemma else cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS or (act != "silu" and not gemma):
        raise ValueError(f"unsupported hidden_act {act!r} in config.json; supported: 'silu' (Gemma 2 and 3: "
                         "'gelu_pytorch_tanh')")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported config.json: mlp_bias=true (the MLP has no bias)")
    if family in ("qwen3", "gemma2", "gemma3") and cfg.get("attention_bias"):
        raise ValueError(f"unsupported config.json: {family} attention_bias=true (o_proj with a bias) is not supported")
    window = _sliding_window(cfg, family)
    rope_params = dict(cfg.get("rope_parameters") or {})
    theta = gemma["theta"] if gemma else cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    stored = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if dtype is None:
        dtype = stored if stored in ("float32", "bfloat16") else "float32"
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rope_theta=float(theta),
        rope_scaling=_rope_scaling({"rope_scaling": gemma["scaling"]} if gemma else cfg),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias")),
        **({} if gemma else {"qk_norm": family == "qwen3"}),
        hidden_act=ACTIVATIONS[act],
        sliding_window=window,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        dtype=dtype,
        param_dtype=dtype,
        architecture=family,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        pad_token_id=cfg.get("pad_token_id"),
        **(gemma["extra"] if gemma else {}),
    )
