"""Build small test LLMs locally (no downloads): random-weight Hugging Face checkpoints,
a locally built byte-level BPE tokenizer, then onnxruntime-genai's model builder.

    python models/build_llm.py --arch llama --precision fp32 --size tiny
    python models/build_llm.py --all-tiny
    python models/build_llm.py --arch qwen2 --precision int4 --size 0.5b     # benchmark sizes

Output: models/out/<arch>-<size>-<precision>/ (genai_config.json, model.onnx, tokenizer files).
A finished build is cached: it is skipped when its marker file exists (--force rebuilds).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_ROOT = os.path.join(HERE, "out")
ARCHS = ("llama", "qwen2", "phi3")
PRECISIONS = ("fp32", "fp16", "int8", "int4")
MARKER = ".ortmlx_build.json"
#: bump when the recipe changes so cached builds are redone
RECIPE = 3
#: the benchmark sizes' own recipe on top of RECIPE (bump it to redo only their builds): their residual
#: branches' output projections (o_proj, down_proj) scaled by 1/sqrt(2 * layers) as GPT-2 initializes them,
#: so a deep random model's residual stream stays inside float16, and a context of 8,192 positions (a 4,096-token
#: prompt plus the tokens generated after it). Largest |residual| over a 32-token prompt in float32: 1.5B 67,832
#: unscaled (past float16's 65,504: its float16 forward gives inf/NaN logits), 9,182 scaled; 0.5B 28,454 / 4,316
BENCH_RECIPE = 1

#: special tokens, appended after the BPE vocabulary; ids are vocab_size - len(SPECIALS) + k
SPECIALS = ("<|endoftext|>", "<|bos|>", "<|pad|>")

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)

SIZES: dict[str, dict] = {
    "tiny": {"llama": _TINY, "qwen2": {**_TINY, "tie_word_embeddings": True},
             # Phi3: fused qkv_proj / gate_up_proj, MHA (kv heads = heads) like Phi-3-mini
             "phi3": {**_TINY, "num_key_value_heads": 4}},
    # tiny width at Qwen2.5-0.5B's depth (24 layers: 48 KV buffers): the EP's per-call overhead
    # with almost no compute (scripts/decode_probe.py)
    "deep": {a: {**_TINY, "num_hidden_layers": 24, "tie_word_embeddings": a == "qwen2"} for a in ARCHS},
    # Qwen2.5-0.5B / 1.5B shapes (random weights, benchmarks only; BENCH_RECIPE)
    "0.5b": {a: dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=8192,
                     tie_word_embeddings=True) for a in ARCHS},
    "1.5b": {a: dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=8192,
                     tie_word_embeddings=True) for a in ARCHS},
}
#: sizes built with BENCH_RECIPE
BENCH_SIZES = ("0.5b", "1.5b")
#: the weights BENCH_RECIPE scales by 1/sqrt(2 * layers): each residual branch's last projection
SCALED_PROJ = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def recipe(size: str):
    """The recipe a build of ``size`` is marked with (cached builds of another recipe are redone)."""
    return f"{RECIPE}.{BENCH_RECIPE}" if size in BENCH_SIZES else RECIPE


def model_name(arch: str, size: str, precision: str) -> str:
    return f"{arch}-{size}-{precision}"


def out_dir(arch: str, size: str, precision: str, root: str = OUT_ROOT) -> str:
    return os.path.join(root, model_name(arch, size, precision))


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
    kw = dict(SIZES[size][arch])
    kw.update(bos_token_id=special["<|bos|>"], eos_token_id=special["<|endoftext|>"],
              pad_token_id=special["<|pad|>"], rms_norm_eps=1e-5, rope_theta=10000.0,
              # 0.3 (HF default 0.02): sharp enough attention that greedy decoding depends on the
              # context (60/64 distinct tokens for tiny llama instead of one token repeated)
              initializer_range=0.3, dtype="float32")
    kw.setdefault("tie_word_embeddings", False)
    if arch == "llama":
        return transformers.LlamaConfig(**kw, attention_bias=False, mlp_bias=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**kw, use_sliding_window=False)
    if arch == "phi3":
        # original == max position embeddings: plain RoPE (the builder's Phi3MiniModel, not LongRoPE)
        return transformers.Phi3Config(**kw, original_max_position_embeddings=kw["max_position_embeddings"],
                                       resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")


def build_hf(arch: str, size: str, directory: str, seed: int = 0) -> None:
    """Random-weight checkpoint + tokenizer in ``directory`` (save_pretrained layout)."""
    import transformers

    os.makedirs(directory, exist_ok=True)
    vocab_size = SIZES[size][arch]["vocab_size"]
    special = build_tokenizer(directory, vocab_size)
    model = init_model(arch, size, special, seed)
    config = model.config
    model.save_pretrained(directory, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                  pad_token_id=config.pad_token_id, do_sample=False).save_pretrained(directory)


def init_model(arch: str, size: str, special: dict[str, int], seed: int = 0, scale_proj: bool | None = None):
    """The random-weight float32 model of ``build_hf`` (``scale_proj``: BENCH_RECIPE's scaled output
    projections; default: for the benchmark sizes)."""
    import math

    import torch
    import transformers

    config = hf_config(arch, size, special)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                # HF initialises biases to zero and the builder drops all-zero biases: make them real
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                # RMSNorm weights start at 1: perturb them so the scale is exercised
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
        if scale_proj is None:
            scale_proj = size in BENCH_SIZES
        if scale_proj:
            f = 1.0 / math.sqrt(2 * config.num_hidden_layers)
            for name, p in model.named_parameters():
                if name.endswith(SCALED_PROJ):
                    p.mul_(f)
    return model.eval()


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


def run_builder(hf_dir: str, out: str, precision: str, cache_dir: str, extra: dict | None = None) -> None:
    """``python -m onnxruntime_genai.models.builder -i hf_dir -o out -p precision -e cpu -c cache_dir``,
    run in this process (saves the ~5 s import per model)."""
    b = _genai_builder()
    kv = [f"{k}={v}" for k, v in (extra or {}).items()]
    opts = b.parse_extra_options(None, hf_dir, out, precision, "cpu", cache_dir, kv)
    b.create_model(None, hf_dir, out, precision, "cpu", cache_dir, **opts)


def build(arch: str, precision: str, size: str = "tiny", root: str = OUT_ROOT, force: bool = False,
          verbose: bool = True) -> str:
    """Build (or reuse) models/out/<arch>-<size>-<precision>; return its directory."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {PRECISIONS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {sorted(SIZES)}")
    out = out_dir(arch, size, precision, root)
    if not force and _is_built(out, size):
        return out
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be building the same model
        if not force and _is_built(out, size):
            return out
        return _build_locked(arch, precision, size, root, out, force, verbose)


def _is_built(out: str, size: str) -> bool:
    try:
        with open(os.path.join(out, MARKER)) as f:
            return json.load(f).get("recipe") == recipe(size)
    except (OSError, ValueError):
        return False


def ensure_hf(arch: str, size: str, root: str = OUT_ROOT, force: bool = False) -> str:
    """The random-weight checkpoint <root>/hf/<arch>-<size>, built unless cached at this recipe."""
    hf_dir = os.path.join(root, "hf", f"{arch}-{size}")
    hf_marker = os.path.join(hf_dir, MARKER)
    try:
        cached = not force and json.load(open(hf_marker)).get("recipe") == recipe(size)
    except (OSError, ValueError):
        cached = False
    if not cached:
        shutil.rmtree(hf_dir, ignore_errors=True)
        build_hf(arch, size, hf_dir)
        with open(hf_marker, "w") as f:
            json.dump({"recipe": recipe(size)}, f)
    return hf_dir


def _build_locked(arch, precision, size, root, out, force, verbose) -> str:
    t0 = time.perf_counter()
    hf_dir = ensure_hf(arch, size, root, force)
    shutil.rmtree(out, ignore_errors=True)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    run_builder(hf_dir, tmp, precision, os.path.join(root, "cache", f"{arch}-{size}-{precision}"))
    shutil.rmtree(os.path.join(root, "cache", f"{arch}-{size}-{precision}"), ignore_errors=True)
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump({"recipe": recipe(size), "arch": arch, "size": size, "precision": precision,
                   "seconds": round(time.perf_counter() - t0, 2)}, f)
    os.replace(tmp, out)
    if verbose:
        print(f"built {out} in {time.perf_counter() - t0:.1f}s", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=ARCHS)
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--all-tiny", action="store_true", help="every arch x precision at the tiny size")
    ap.add_argument("--out", default=OUT_ROOT, help="output root (default models/out)")
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    args = ap.parse_args(argv)
    if args.all_tiny:
        jobs = [(a, p, "tiny") for a in ARCHS for p in PRECISIONS]
    elif args.arch:
        jobs = [(args.arch, args.precision, args.size)]
    else:
        ap.error("give --arch (with --precision/--size) or --all-tiny")
    t0 = time.perf_counter()
    for a, p, s in jobs:
        d = build(a, p, s, root=args.out, force=args.force)
        print(d)
    print(f"total {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
