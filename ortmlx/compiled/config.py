"""What a compiled subgraph does: one core, three strategies as configurations."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SHAPELESS = "shapeless"
SHAPE_KEYED = "shape_keyed"


@dataclass(frozen=True)
class CompiledConfig:
    """How ``CompiledSubgraph`` traces and replays a group.

    - ``shape_mode``: ``shapeless`` (one trace for every length, verified at two lengths
      before it is trusted) or ``shape_keyed`` (one trace per input-shape key).
    - ``kv_alias``: present K/V outputs may share the past K/V buffer (genai's shared buffer).
      Informational: the aliasing is detected and served generically by ``ep/compute.py`` +
      ``runtime/mirror.py`` (any output ORT places in an input's buffer, whichever runner ran), which
      the closures allow by returning their outputs as MLX arrays.
    - ``rope_as_data``: RoPE position and valid past length are closure inputs, not baked
      (the traced RotaryEmbedding / GroupQueryAttention forms in ``attention.py`` do this).
    - ``delta_copyout``: with an aliased KV buffer only the new rows are written back.
      Informational, like ``kv_alias``: ``runtime/mirror.py`` finds the changed rows by a device diff
      against the mirror (no hint from the runner needed), for every runner.
    - ``contiguous_outputs``: outputs are made row-contiguous inside the trace.
    """
    name: str
    shape_mode: str = SHAPE_KEYED
    kv_alias: bool = False
    rope_as_data: bool = False
    delta_copyout: bool = False
    contiguous_outputs: bool = False
    #: most closures one runner keeps (new keys beyond it run eagerly)
    max_keys: int = 16
    #: stop tracing new keys once this many exist and none was ever replayed
    thrash_keys: int = 4
    #: calls of a key answered eagerly before it is traced: a key met once (a one-shot session, a shape that never
    #: comes back) then never pays the trace and its kernels' build
    eager_calls_before_trace: int = 0

    def __post_init__(self):
        if self.shape_mode not in (SHAPELESS, SHAPE_KEYED):
            raise ValueError(f"shape_mode must be {SHAPELESS!r} or {SHAPE_KEYED!r}, got {self.shape_mode!r}")

    @property
    def shapeless(self) -> bool:
        return self.shape_mode == SHAPELESS


GENERAL = CompiledConfig("general", SHAPE_KEYED, contiguous_outputs=True, eager_calls_before_trace=1)
PREFILL = CompiledConfig("prefill", SHAPE_KEYED, kv_alias=True, rope_as_data=True, delta_copyout=True)
#: a prefill no bucket takes (a batch, a chunk after a past): traced only when its exact shapes come back
PREFILL_EXACT = dataclasses.replace(PREFILL, eager_calls_before_trace=1)
DECODE = CompiledConfig("decode", SHAPELESS, kv_alias=True, rope_as_data=True, delta_copyout=True, max_keys=4)
