"""Build small test LLMs locally (no downloads): random-weight Hugging Face checkpoints,
a locally built byte-level BPE tokenizer, then onnxruntime-genai's model builder.

    python models/build_llm.py --arch llama --precision fp32 --size tiny
    python models/build_llm.py --all-tiny                  # llama, qwen2, phi3 x fp32/fp16/int8/int4
    python models/build_llm.py --all-archs                 # every arch x target x precision (see MATRIX)
    python models/build_llm.py --arch gemma2 --target cuda --precision bf16
    python models/build_llm.py --list                      # the archs, what each exercises
    python models/build_llm.py --arch qwen2 --precision int4 --size 0.5b     # benchmark sizes

Output: models/out/<arch>-<size>-<precision>/ for ``--target cpu`` (the builder's ``-e cpu``) and
models/out/<arch>-<size>-<precision>-cuda/ for ``--target cuda`` (``-e cuda``: the graph a GPU user
gets; it is built on any machine). A finished build is cached: it is skipped when its marker file
exists (--force rebuilds). A build the builder cannot make leaves ``<name>.failed.json`` with a
one-line reason (``build`` raises ``BuildError``; ``--all-archs`` prints it and goes on).
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import math
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_ROOT = os.path.join(HERE, "out")
#: the archs the rest of the suite builds (--all-tiny: tests/test_llm_genai.py, scripts/llm_report.py)
BASE_ARCHS = ("llama", "qwen2", "phi3")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
#: the builder's execution provider (``-e``): cpu graphs run on ORT's CPU EP; cuda graphs are what a
#: GPU user gets (fused q/k norms, packed QKV, fp16/bf16 GQA), built here on any machine
TARGETS = ("cpu", "cuda")
#: what --all-archs builds per target
MATRIX = {"cpu": ("fp32", "int4"), "cuda": ("fp16", "bf16")}
MARKER = ".ortmlx_build.json"
FAILED = ".failed.json"
#: bump when the recipe changes so cached builds are redone
RECIPE = 3

#: special tokens, appended after the BPE vocabulary; ids are vocab_size - len(SPECIALS) + k
SPECIALS = ("<|endoftext|>", "<|bos|>", "<|pad|>")

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture genai's builder dispatches on (``config.architectures[0]``), as a tiny
    random-weight checkpoint.

    ``config``: the transformers config class; ``kw``: its arguments over ``_TINY``; ``hub``: keys
    merged into the saved config.json (the Hub's layout where transformers 5 rewrites it, or a
    stand-in's ``architectures``); ``model``: the transformers class whose random weights are saved
    (default ``AutoModelForCausalLM``); ``builder``: extra options for the builder; ``what``: the
    features the graph exercises; ``skip``: why it is not built at all (then nothing is tried)."""
    hf: str
    config: str = ""
    kw: dict = dataclasses.field(default_factory=dict)
    hub: dict = dataclasses.field(default_factory=dict)
    model: str = "AutoModelForCausalLM"
    builder: dict = dataclasses.field(default_factory=dict)
    what: str = ""
    skip: str = ""
    shim: dict = dataclasses.field(default_factory=dict)
    known: str = ""
    #: also write the experts as GPT-OSS's original MXFP4 tensors (what the builder's int4 QMoE reads)
    mxfp4: bool = False


_ALT = ["sliding_attention", "full_attention"]      # local layer, then global layer
ARCHS: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=False, mlp_bias=False),
                  what="RMSNorm, SwiGLU, GQA with fused RoPE"),
    "qwen2": Arch("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False),
                  what="QKV biases, tied embeddings"),
    # original == max position embeddings: plain RoPE (the builder's Phi3MiniModel, not LongRoPE)
    "phi3": Arch("Phi3ForCausalLM", "Phi3Config",
                 dict(num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
                 what="fused qkv_proj / gate_up_proj, MHA (kv heads = heads)"),
    "qwen3": Arch("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, use_sliding_window=False),
                  what="q/k RMSNorm per head (separate nodes at -e cpu, GQA q/k_norm_weight at -e cuda)"),
    "qwen2-swa": Arch("Qwen2ForCausalLM", "Qwen2Config",
                      dict(use_sliding_window=True, sliding_window=24, max_window_layers=1,
                           layer_types=["full_attention", "sliding_attention"]),
                      what="Qwen2 with a sliding window on layer 1 (windowed KV cache)"),
    "mistral": Arch("MistralForCausalLM", "MistralConfig",
                    dict(head_dim=16, sliding_window=24, layer_types=["sliding_attention"] * 2),
                    what="sliding window on every layer (windowed KV cache, window 24 < 64 tokens)"),
    "gemma": Arch("GemmaForCausalLM", "GemmaConfig", dict(head_dim=16, hidden_activation="gelu_pytorch_tanh"),
                  what="embedding scale, (1 + w) RMSNorm, GeGLU"),
    "gemma2": Arch("Gemma2ForCausalLM", "Gemma2Config",
                   dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, layer_types=_ALT),
                   what="attention/final softcaps, local+global layers (windowed KV cache on the local one)"),
    "gemma3": Arch("Gemma3ForCausalLM", "Gemma3TextConfig",
                   dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16, layer_types=_ALT),
                   # transformers 5 turns the Hub's rope_theta / rope_local_base_freq into rope_parameters per
                   # layer type, which builder 0.18 does not read (KeyError 'rope_type'): a flat
                   # rope_parameters, and the local theta set back on the config the builder loads
                   hub=dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
                   shim=dict(rope_local_base_freq=10000.0),
                   what="q/k norms, local/global RoPE caches, windowed KV cache"),
    "gptoss": Arch("GptOssForCausalLM", "GptOssConfig",
                   dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                        layer_types=_ALT, intermediate_size=64,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=2.0,
                                             beta_slow=0.5, original_max_position_embeddings=64, truncate=False)),
                   # (beta 32/1 as gpt-oss has them leave no YaRN ramp inside a head of 16: the builder asserts)
                   mxfp4=True,
                   what="MoE/QMoE (SwiGLU experts, top-k router), attention sinks, YaRN, windowed KV cache"),
    "granite": Arch("GraniteForCausalLM", "GraniteConfig",
                    dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                         logits_scaling=4.0),
                    what="embedding/residual/attention multipliers, logits scaling"),
    "granitemoehybrid": Arch("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                             dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                                  mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                                  mamba_chunk_size=16, layer_types=["attention", "attention"]),
                             # builder 0.18 makes attention layers only (a Mamba layer has no self_attn: it fails)
                             # and the shared MLP of each (the routed experts are not exported)
                             what="Granite 4 attention layers (shared MLP; the builder exports no Mamba layers, "
                                  "no routed experts)"),
    "hunyuan": Arch("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", dict(head_dim=16),
                    what="q/k norms after RoPE"),
    "lfm2": Arch("Lfm2ForCausalLM", "Lfm2Config",
                 dict(full_attn_idxs=[1], block_multiple_of=16, block_auto_adjust_ff_dim=False, norm_eps=1e-5),
                 what="short-conv layers (causal conv with state) + attention"),
    "lfm2moe": Arch("Lfm2MoeForCausalLM", "Lfm2MoeConfig",
                    dict(moe_intermediate_size=64, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                         layer_types=["conv", "full_attention"], norm_eps=1e-5),
                    what="short-conv layers, MoE with expert bias"),
    "nemotron": Arch("NemotronForCausalLM", "NemotronConfig",
                     # heads of 32: a partial rotary of 16 (GQA's fused rotary needs cos_cache dim 1 a multiple of 8
                     # on both EPs; heads of 16 would give 4)
                     dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, hidden_act="relu2", norm_eps=1e-5,
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
                     what="relu2 MLP, LayerNorm1P, partial rotary"),
    "olmo": Arch("OlmoForCausalLM", "OlmoConfig", what="non-parametric LayerNorm"),
    "olmo2": Arch("Olmo2ForCausalLM", "Olmo2Config", what="q/k norms, post-norms",
                  known="builder 0.18 has no OLMo 2 class: its dispatch knows OlmoForCausalLM only"),
    "phi": Arch("PhiForCausalLM", "PhiConfig",
                dict(num_attention_heads=2, num_key_value_heads=2, hidden_act="gelu_new", resid_pdrop=0.0,
                     embd_pdrop=0.0,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
                what="Phi-2: LayerNorm, FastGelu, parallel attention/MLP, partial rotary"),
    "phi3-longrope": Arch("Phi3ForCausalLM", "Phi3Config",
                          dict(num_key_value_heads=4, original_max_position_embeddings=64, resid_pdrop=0.0,
                               embd_pdrop=0.0, attention_dropout=0.0),
                          hub=dict(rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.05 * i for i in range(8)],
                                                     long_factor=[1.0 + 0.5 * i for i in range(8)]),
                                   rope_theta=10000.0),
                          what="Phi-3.5/Phi-4 LongRoPE (two caches chosen by an If)"),
    "phimoe": Arch("PhiMoEForCausalLM", "PhimoeConfig",
                   dict(num_local_experts=4, num_experts_per_tok=2, original_max_position_embeddings=64),
                   hub=dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                              short_mscale=1.1, long_mscale=1.2), rope_theta=10000.0),
                   # transformers 5 moves original_max_position_embeddings into rope_parameters (as the max): the
                   # builder dispatches PhiMoE only when they differ
                   shim=dict(original_max_position_embeddings=64),
                   known="builder 0.18's base make_rope_init raises on rope_type longrope, which transformers 5 puts in "
                         "rope_parameters (its Phi-3 LongRoPE class reads it; the PhiMoE class does not)",
                   what="Phi-3.5-MoE (sparsemixer router, LongRoPE)"),
    "qwen3_5": Arch("Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                    dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         layer_types=["linear_attention", "full_attention"],
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
                    what="gated DeltaNet linear attention + gated full attention",
                    known="builder 0.18 dispatches Qwen3.5 only as Qwen3_5ForConditionalGeneration (the VLM "
                          "checkpoint, with its vision tower), not the text-only Qwen3_5ForCausalLM"),
    "smollm3": Arch("SmolLM3ForCausalLM", "SmolLM3Config", dict(no_rope_layers=[1, 0], no_rope_layer_interval=2),
                    what="no-RoPE layers",
                    known="builder 0.18's SmolLM3 no-RoPE layer clears use_rope_in_attn instead of rope, so it asks "
                          "for a RotaryEmbedding on position_ids, which a fused-RoPE graph has no input for"),
    "smollm3-rope": Arch("SmolLM3ForCausalLM", "SmolLM3Config", dict(no_rope_layers=[1, 1], no_rope_layer_interval=4),
                         what="SmolLM3 with RoPE on every layer (what builder 0.18 can make of it)"),
    "ernie": Arch("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(head_dim=16), what="interleaved rotary"),
    # stand-ins: a Llama checkpoint under the name the builder dispatches on (the real ones need remote code);
    # the builder makes the arch's graph (ChatGLM: half, interleaved rotary) from its weights
    "chatglm": Arch("ChatGLMModel", "LlamaConfig", dict(attention_bias=False, num_attention_heads=2, num_key_value_heads=1),
                    hub=dict(architectures=["ChatGLMModel"]),
                    what="stand-in: Llama weights, ChatGLM's partial interleaved rotary"),
    "internlm2": Arch("InternLM2ForCausalLM", "LlamaConfig", hub=dict(architectures=["InternLM2ForCausalLM"]),
                      what="stand-in: Llama weights through the InternLM2 builder"),
    # what the builder dispatches on but cannot be made tiny here
    "phi3small": Arch("Phi3SmallForCausalLM", skip="needs remote code (no transformers class)",
                      what="blocksparse attention"),
    "multimodal": Arch("*ForConditionalGeneration", skip="multimodal checkpoints (vision/audio towers: Qwen2.5-VL, "
                       "Qwen3-VL, Qwen3.5 VL, Phi-3-V, Phi-4-MM, LFM2-VL/Audio, Gemma 3/4, Mistral 3, Whisper, "
                       "VideoChat-Flash); their text decoders are the archs above",
                       what="text decoder of a VLM/ASR model"),
}

SIZES: dict[str, dict] = {
    "tiny": {a: {} for a in ARCHS},
    # tiny width at Qwen2.5-0.5B's depth (24 layers: 48 KV buffers): the EP's per-call overhead
    # with almost no compute (scripts/decode_probe.py)
    "deep": {a: {"num_hidden_layers": 24, "tie_word_embeddings": a == "qwen2"} for a in BASE_ARCHS},
    # tiny depth, each product's weight >= 64 KiB (dtypes.DEVICE_COPY_BYTES): on a GPU they are stored column-major
    # and decode rows take our row kernels, so a decode step is our kernels only (the decode replay's tests). The MLP
    # is not 512 wide: with the LM head's [256, 512] shape the genai 0.18 builder wired the head to layer 0's
    # post-attention norm, whose gate/up products then merged with it and their gating stayed MLX's
    "small": {a: dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)
              for a in BASE_ARCHS},
    # Qwen2.5-0.5B / 1.5B shapes (random weights, benchmarks only: BENCH_SIZES)
    "0.5b": {a: dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=8192,
                     tie_word_embeddings=True) for a in BASE_ARCHS},
    "1.5b": {a: dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=8192,
                     tie_word_embeddings=True) for a in BASE_ARCHS},
}


class BuildError(RuntimeError):
    """The builder (or transformers) could not make this model; ``str()`` is one line."""


#: the benchmark sizes: their residual branches' output projections (o_proj, down_proj) are scaled by
#: 1/sqrt(2 * layers) as GPT-2 initializes them, so a deep random model's residual stream stays inside float16,
#: and their context is 8,192 positions (a 4,096-token prompt plus the tokens generated after it). Largest
#: |residual| over a 32-token prompt in float32: 1.5B 67,832 unscaled (past float16's 65,504: its float16 forward
#: gives inf/NaN logits), 9,182 scaled; 0.5B 28,454 / 4,316
BENCH_SIZES = ("0.5b", "1.5b")
SCALED_PROJ = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def model_name(arch: str, size: str, precision: str, target: str = "cpu") -> str:
    base = f"{arch}-{size}-{precision}"
    return base if target == "cpu" else f"{base}-{target}"


def out_dir(arch: str, size: str, precision: str, root: str = OUT_ROOT, target: str = "cpu") -> str:
    return os.path.join(root, model_name(arch, size, precision, target))


def gqa_dir(size: str, precision: str, arch: str = "qwen2", root: str = OUT_ROOT, prune: bool = False) -> str:
    """scripts/bench_models.py's ``-e cuda`` benchmark build (``prune``: with the builder's ``prune_lm_head``)."""
    return os.path.join(root, f"{arch}-{size}-{precision}-gqa" + ("-prune" if prune else ""))


def config_kwargs(arch: str, size: str) -> dict:
    """The HF config arguments of ``arch`` at ``size``."""
    a = ARCHS[arch]
    kw = {**_TINY, **a.kw, **SIZES[size][arch]}
    if "layer_types" in kw:
        kw["num_hidden_layers"] = len(kw["layer_types"])
    return kw


# --------------------------------------------------------------------------- tokenizer
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _bpe_vocab(n_tokens: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A valid byte-level BPE with exactly ``n_tokens`` entries, built deterministically.

    The 256 byte symbols, then merges that grow lowercase words (with and without the
    leading-space marker 'Ġ') one letter at a time, shortest first.
    """
    alphabet = list(_bytes_to_unicode().values())
    if n_tokens < len(alphabet):
        raise ValueError(f"vocabulary of {n_tokens!r} tokens is smaller than the 256 byte symbols")
    vocab = {s: i for i, s in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    frontier = ["Ġ"] + list(letters)             # prefixes to extend
    while len(vocab) < n_tokens:
        nxt = []
        for pre in frontier:
            for c in letters:
                if len(vocab) >= n_tokens:
                    break
                tok = pre + c
                if tok in vocab:
                    continue
                merges.append((pre, c))
                vocab[tok] = len(vocab)
                nxt.append(tok)
        frontier = nxt
    return vocab, merges


def build_tokenizer(directory: str, vocab_size: int) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json (vocab_size tokens in all); return special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import AddedToken

    vocab, merges = _bpe_vocab(vocab_size - len(SPECIALS))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    if tok.get_vocab_size() != vocab_size or sorted(ids.values()) != list(range(vocab_size - len(SPECIALS), vocab_size)):
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens / specials {ids}, wanted {vocab_size}")
    tok.save(os.path.join(directory, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<|bos|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "unk_token": None,
        "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "added_tokens_decoder": {str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for s, i in ids.items()},
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}, f, indent=2)
    return ids


# --------------------------------------------------------------------------- HF checkpoint
def hf_config(arch: str, size: str, special: dict[str, int]):
    import transformers
    a = ARCHS[arch]
    if a.skip:
        raise BuildError(f"{arch}: not built: {a.skip}")
    kw = config_kwargs(arch, size)
    kw.update(bos_token_id=special["<|bos|>"], eos_token_id=special["<|endoftext|>"],
              pad_token_id=special["<|pad|>"],
              # 0.3 (HF default 0.02): sharp enough attention that greedy decoding depends on the
              # context (60/64 distinct tokens for tiny llama instead of one token repeated)
              initializer_range=0.3, dtype="float32")
    kw.setdefault("rms_norm_eps", 1e-5)
    if "rope_parameters" not in kw:
        kw.setdefault("rope_theta", 10000.0)
    kw.setdefault("tie_word_embeddings", False)
    if arch == "phi3":
        kw["original_max_position_embeddings"] = kw["max_position_embeddings"]
    cls = getattr(transformers, a.config, None)
    if cls is None:
        raise BuildError(f"{arch}: transformers {transformers.__version__} has no {a.config}")
    return cls(**kw)


def build_hf(arch: str, size: str, directory: str, seed: int = 0) -> None:
    """Random-weight checkpoint + tokenizer in ``directory`` (save_pretrained layout)."""
    import torch
    import transformers

    os.makedirs(directory, exist_ok=True)
    vocab_size = config_kwargs(arch, size)["vocab_size"]
    special = build_tokenizer(directory, vocab_size)
    config = hf_config(arch, size, special)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch].model).from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                # HF initialises biases to zero and the builder drops all-zero biases: make them real
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                # RMSNorm weights start at 1: perturb them so the scale is exercised
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
        if size in BENCH_SIZES:
            f = 1.0 / math.sqrt(2 * config.num_hidden_layers)
            for name, p in model.named_parameters():
                if name.endswith(SCALED_PROJ):
                    p.mul_(f)
    model.eval()
    mx4 = _mxfp4_experts(model) if ARCHS[arch].mxfp4 else None
    model.save_pretrained(directory, safe_serialization=True)
    if mx4 is not None:
        _save_extra_tensors(directory, mx4, "mxfp4.safetensors")
    transformers.GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                  pad_token_id=config.pad_token_id, do_sample=False).save_pretrained(directory)
    cfg_path = os.path.join(directory, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = [ARCHS[arch].hf]
    cfg.update(ARCHS[arch].hub)
    if ARCHS[arch].hub.get("rope_scaling") is not None or "rope_local_base_freq" in ARCHS[arch].hub:
        cfg.pop("rope_parameters", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_quantize(w):
    """MXFP4 of ``w`` (E, N, K) along K, GPT-OSS's checkpoint layout: (blocks (E, N, K/32, 16) uint8, two E2M1
    codes a byte, low nibble first; scales (E, N, K/32) uint8, the block's power of two + 127) and the values
    they decode to (E, N, K) float32."""
    import torch
    e, n, k = w.shape
    b = w.reshape(e, n, k // 32, 32).to(torch.float32)
    amax = b.abs().amax(-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    q = b / torch.pow(2.0, exp).unsqueeze(-1)
    lut = torch.tensor(_E2M1)
    idx = (q.abs().unsqueeze(-1) - lut).abs().argmin(-1)
    codes = (idx | torch.where((q < 0) & (idx > 0), 8, 0)).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    vals = lut[idx] * torch.where(codes >= 8, -1.0, 1.0) * torch.pow(2.0, exp).unsqueeze(-1)
    return blocks, (exp + 127).to(torch.uint8).contiguous(), vals.reshape(e, n, k)


def _mxfp4_experts(model) -> dict:
    """GPT-OSS's original MXFP4 expert tensors for ``model``'s experts; the dense experts are set to the
    values those decode to (so the fp32 and the int4 builds start from the same weights, as a real
    gpt-oss checkpoint does)."""
    import torch
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(ex, proj)                        # (E, K, N): input-major
                blocks, scales, vals = mxfp4_quantize(p.transpose(-1, -2))
                p.copy_(vals.transpose(-1, -2))
                out[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                out[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    return out


def _save_extra_tensors(directory: str, tensors: dict, filename: str) -> None:
    """Add ``tensors`` to the checkpoint in ``directory`` as another safetensors file (an index lists both)."""
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(directory, filename))
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
    else:
        from safetensors import safe_open
        with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
            idx = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}  # noqa: SIM118
    idx["weight_map"].update({k: filename for k in tensors})
    with open(index, "w") as f:
        json.dump(idx, f, indent=2)


# --------------------------------------------------------------------------- ONNX via genai's builder
def _genai_builder():
    """onnxruntime-genai's model builder module, imported in this process (it imports its
    siblings as top-level modules, so its directory goes on sys.path)."""
    import onnxruntime_genai.models as m
    d = os.path.dirname(os.path.abspath(m.__file__))
    if d not in sys.path:
        sys.path.insert(0, d)
    import builder  # noqa: E402  (onnxruntime_genai/models/builder.py)
    return builder


def run_builder(hf_dir: str, out: str, precision: str, cache_dir: str, extra: dict | None = None,
                target: str = "cpu", shim: dict | None = None) -> None:
    """``python -m onnxruntime_genai.models.builder -i hf_dir -o out -p precision -e target -c cache_dir``,
    run in this process (saves the ~5 s import per model); ``shim``: attributes set on the config it loaded."""
    b = _genai_builder()
    kv = [f"{k}={v}" for k, v in (extra or {}).items()]
    opts = b.parse_extra_options(None, hf_dir, out, precision, target, cache_dir, kv)
    for k, v in (shim or {}).items():
        setattr(opts["hf_details"]["hf_config"], k, v)
    b.create_model(None, hf_dir, out, precision, target, cache_dir, **opts)


def build(arch: str, precision: str, size: str = "tiny", root: str = OUT_ROOT, force: bool = False,
          verbose: bool = True, target: str = "cpu") -> str:
    """Build (or reuse) models/out/<name>; return its directory. Raises ``BuildError`` (one line:
    which arch and why) when transformers or the builder cannot make it; the failure is cached
    next to the build (``<name>.failed.json``) until ``force`` or a recipe change."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(ARCHS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {PRECISIONS}")
    if size not in SIZES or arch not in SIZES[size]:
        raise ValueError(f"unknown size {size!r} for {arch!r}; known: {sorted(s for s in SIZES if arch in SIZES[s])}")
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known: {TARGETS}")
    out = out_dir(arch, size, precision, root, target)
    fp = fingerprint(arch, size)
    if not force and _is_built(out, fp):
        return out
    failed = failure(out, fp)
    if failed and not force:
        raise BuildError(failed)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be building the same model
        if not force and _is_built(out, fp):
            return out
        try:
            return _build_locked(arch, precision, size, root, out, force, verbose, target)
        except BuildError as e:
            _record_failure(out, str(e), fp)
            raise
        except Exception as e:  # noqa: BLE001 - the builder's own errors: recorded as one line
            # (paths inside the output root are named from it: the reason goes into docs)
            msg = f"{arch} {target} {precision}: {_one_line(e)}".replace(os.path.abspath(root) + os.sep, "")
            if ARCHS[arch].known:
                msg += f" [{ARCHS[arch].known}]"
            _record_failure(out, msg, fp)
            raise BuildError(msg) from e


def _one_line(e: BaseException) -> str:
    """``Type: first line of the message`` of ``e`` (and of the error it was raised from)."""
    s = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {s[0][:300] if s else ''}"
    cause = e.__cause__ or e.__context__
    if cause is not None and not isinstance(e, BuildError) and str(cause).strip():
        msg += f" (from {type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]})"
    return msg


def failure(out: str, fp: str | None = None) -> str | None:
    """The recorded one-line reason a build failed (None: not failed, or failed under another recipe)."""
    try:
        with open(out + FAILED) as f:
            d = json.load(f)
        return d["reason"] if d.get("recipe") == RECIPE and (fp is None or d.get("config") == fp) else None
    except (OSError, ValueError, KeyError):
        return None


def _record_failure(out: str, reason: str, fp: str | None = None) -> None:
    with open(out + FAILED, "w") as f:
        json.dump({"recipe": RECIPE, "reason": reason, "config": fp}, f)


def _is_built(out: str, fp: str | None = None) -> bool:
    try:
        with open(os.path.join(out, MARKER)) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return False
    return m.get("recipe") == RECIPE and (fp is None or m.get("config") == fp)


def fingerprint(arch: str, size: str) -> str:
    """What the checkpoint and the builder's input depend on: a change rebuilds both."""
    a = ARCHS[arch]
    return json.dumps([config_kwargs(arch, size), a.hub, a.shim, a.model, a.builder, a.mxfp4, a.known,
                       "proj/sqrt(2L)" if size in BENCH_SIZES else None], sort_keys=True, default=str)


def ensure_hf(arch: str, size: str, root: str = OUT_ROOT, force: bool = False) -> str:
    """The random-weight checkpoint <root>/hf/<arch>-<size>, built unless cached with this fingerprint."""
    hf_dir = os.path.join(root, "hf", f"{arch}-{size}")
    hf_marker = os.path.join(hf_dir, MARKER)
    fp = fingerprint(arch, size)
    if force or not _is_built(hf_dir, fp):
        shutil.rmtree(hf_dir, ignore_errors=True)
        try:
            build_hf(arch, size, hf_dir)
        except BuildError:
            raise
        except Exception as e:  # noqa: BLE001
            raise BuildError(f"{arch}: the checkpoint: {_one_line(e)}") from e
        with open(hf_marker, "w") as f:
            json.dump({"recipe": RECIPE, "config": fp}, f)
    return hf_dir


def _build_locked(arch, precision, size, root, out, force, verbose, target="cpu") -> str:
    t0 = time.perf_counter()
    fp = fingerprint(arch, size)
    hf_dir = ensure_hf(arch, size, root, force)
    shutil.rmtree(out, ignore_errors=True)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    name = os.path.basename(out)
    cache = os.path.join(root, "cache", name)
    try:
        run_builder(hf_dir, tmp, precision, cache, ARCHS[arch].builder, target, ARCHS[arch].shim)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if not os.path.exists(os.path.join(tmp, "model.onnx")):
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"{arch} {target} {precision}: the builder wrote no model.onnx")
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump({"recipe": RECIPE, "arch": arch, "size": size, "precision": precision, "target": target,
                   "seconds": round(time.perf_counter() - t0, 2), "config": fp}, f)
    os.replace(tmp, out)
    try:
        os.remove(out + FAILED)
    except OSError:
        pass
    if verbose:
        print(f"built {out} in {time.perf_counter() - t0:.1f}s", flush=True)
    return out


def matrix(archs=None) -> list[tuple[str, str, str]]:
    """(arch, target, precision) of every case --all-archs builds."""
    return [(a, t, p) for a in (archs or ARCHS) for t in TARGETS for p in MATRIX[t]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), action="append", help="repeatable")
    ap.add_argument("--precision", choices=PRECISIONS, default=None, help="default: fp32 (cpu), fp16 (cuda)")
    ap.add_argument("--target", choices=TARGETS, default="cpu", help="the builder's -e (default cpu)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--all-tiny", action="store_true", help="llama/qwen2/phi3 x fp32/fp16/int8/int4 at -e cpu")
    ap.add_argument("--all-archs", action="store_true",
                    help="every arch (or those --arch names) x target x precision of MATRIX")
    ap.add_argument("--list", action="store_true", help="list the archs and exit")
    ap.add_argument("--out", default=OUT_ROOT, help="output root (default models/out)")
    ap.add_argument("--force", action="store_true", help="rebuild even when cached (or cached as failed)")
    args = ap.parse_args(argv)
    if args.list:
        for k, a in ARCHS.items():
            print(f"{k:18s} {a.hf:30s} {a.skip and 'NOT BUILT: ' + a.skip or a.what}")
        return 0
    if args.all_tiny:
        jobs = [(a, "cpu", p) for a in BASE_ARCHS for p in ("fp32", "fp16", "int8", "int4")]
    elif args.all_archs:
        jobs = matrix(args.arch)
    elif args.arch:
        jobs = [(a, args.target, args.precision or ("fp32" if args.target == "cpu" else "fp16")) for a in args.arch]
    else:
        ap.error("give --arch (with --precision/--target/--size), --all-tiny or --all-archs")
    t0 = time.perf_counter()
    failed = 0
    for a, t, p in jobs:
        try:
            print(build(a, p, args.size, root=args.out, force=args.force, target=t), flush=True)
        except BuildError as e:
            failed += 1
            print(f"FAILED {model_name(a, args.size, p, t)}: {e}", flush=True)
    print(f"total {time.perf_counter() - t0:.1f}s, {len(jobs) - failed} built, {failed} failed")
    return 1 if failed and not args.all_archs else 0


if __name__ == "__main__":
    sys.exit(main())
