"""RoPE scaling tables (model.rope_scaling, Hugging Face's rope_scaling): the kinds tiertrain builds
(model/llama.py's rope_inv_freq) and each one's keys, checked. No torch here."""

from __future__ import annotations

import math

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _finite(v: object) -> bool:
    """A positive finite number."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def rope_problem(rs: object) -> str | None:
    """Why the scaling table `rs` is not one tiertrain builds (None: it is)."""
    if not isinstance(rs, dict):
        return 'must be a table like {rope_type = "llama3", factor = 8.0, ...}'
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ROPE_TYPES:
        return f"rope_type must be one of {', '.join(ROPE_TYPES)}"
    if "factor" in rs and not _finite(rs["factor"]):
        return "factor must be a positive finite number"
    if kind in ("linear", "dynamic") and "factor" not in rs:
        return f"{kind} scaling needs factor"
    if (
        kind == "yarn"
    ):  # its optional keys: null (or 0, but for attention_factor) is the default, as in transformers
        bad = [k for k in _YARN_OPTIONAL if rs.get(k) is not None and not (_finite(rs[k]) or rs[k] == 0)]
        bad += ["attention_factor"] * (rs.get("attention_factor") == 0)
        bad += ["truncate"] * (not isinstance(rs.get("truncate", True), bool))
        if bad:
            return f"yarn's {', '.join(bad)} must be finite numbers (truncate: a bool)"
        if not all(k in rs and _finite(rs[k]) for k in ("factor", "original_max_position_embeddings")):
            return "yarn scaling needs factor and original_max_position_embeddings, positive numbers"
    if kind == "llama3":
        missing = [k for k in _LLAMA3 if k not in rs]
        if missing:
            return f"llama3 scaling needs {', '.join(missing)}"
        bad = [k for k in _LLAMA3 if not _finite(rs[k])]
        if bad:
            return f"{', '.join(bad)} must be positive finite numbers, not strings"
        if rs["high_freq_factor"] == rs["low_freq_factor"]:
            return "high_freq_factor must differ from low_freq_factor"
    return None
