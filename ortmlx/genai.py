"""onnxruntime-genai helpers: run genai models on the MLX EP and compare them with the CPU EP.

    from ortmlx import genai as mg
    model, reports = mg.load_model("models/out/llama-tiny-fp32", provider="mlx")
    tokens = mg.greedy(model, prompt_ids, 64)

Used by ``scripts/generate.py``, ``scripts/llm_report.py`` and ``tests/test_llm_genai.py``.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterable

import numpy as np

from . import EP_NAME, partition_reports, register

PROVIDERS = ("mlx", "cpu", "cuda")


def _og():
    import onnxruntime_genai as og
    return og


def make_config(model_dir: str, provider: str = "mlx", options: dict | None = None,
                overlay: dict | None = None):
    """An ``og.Config`` for ``model_dir`` on ``provider`` ("mlx", "cpu" or "cuda").

    "mlx": ``clear_providers(); append_provider("MLXExecutionProvider")`` plus every option
    through ``set_provider_option``. "cpu": ``clear_providers()`` (genai's default, the CPU
    EP). "cuda": ORT's CUDA EP (onnxruntime-genai-cuda), options likewise. ``overlay`` is
    merged into genai_config.json (``Config.overlay``).
    """
    if provider not in PROVIDERS:
        raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")
    og = _og()
    if provider == "mlx":
        register(genai=True)
    config = og.Config(model_dir)
    if overlay:
        config.overlay(json.dumps(overlay))
    config.clear_providers()
    if provider in ("mlx", "cuda"):
        name = EP_NAME if provider == "mlx" else "cuda"
        config.append_provider(name)
        for k, v in (options or {}).items():
            config.set_provider_option(name, str(k), str(v))
    elif options:
        raise ValueError(f"options {options!r} are only for the mlx and cuda providers")
    return config


def load_model(model_dir: str, provider: str = "mlx", options: dict | None = None,
               overlay: dict | None = None, config=None):
    """(``og.Model``, the MLX partition reports made while creating it, oldest first).

    With ``config`` given, it is used as is (``model_dir``/``provider``/``options`` ignored
    except that the EP is registered).
    """
    og = _og()
    register(genai=True)
    before = partition_reports()          # keeps the old reports alive, so `is` is reliable
    if config is None:
        config = make_config(model_dir, provider, options, overlay)
    model = og.Model(config)
    new = [r for r in partition_reports() if not any(r is b for b in before)]
    return model, new


def search_options(model, max_length: int, min_length: int = 0) -> object:
    og = _og()
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, min_length=min_length, do_sample=False, num_beams=1)
    return params


def greedy(model, prompt_ids: Iterable[int], n_new: int, force_length: bool = True) -> list[int]:
    """Greedy decode of ``n_new`` tokens after ``prompt_ids`` (EOS suppressed with
    ``force_length`` so exactly ``n_new`` tokens come back)."""
    og = _og()
    ids = np.asarray(list(prompt_ids), dtype=np.int32)
    total = len(ids) + n_new
    params = search_options(model, total, total if force_length else 0)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out: list[int] = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def stream(model, tokenizer, prompt_ids, n_new: int, force_length: bool = False):
    """Yield (token id, decoded text piece) while decoding greedily."""
    og = _og()
    ids = np.asarray(list(prompt_ids), dtype=np.int32)
    params = search_options(model, len(ids) + n_new, len(ids) + n_new if force_length else 0)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    ts = tokenizer.create_stream()
    while not gen.is_done():
        gen.generate_next_token()
        t = int(gen.get_next_tokens()[0])
        yield t, ts.decode(t)


def forced_logits(model, prompt_ids: Iterable[int], forced: Iterable[int]) -> list[np.ndarray]:
    """Last-position logits (float32, shape [vocab]) after the prompt, then after each forced
    token (teacher forcing: both EPs see the same tokens, so their logits are comparable)."""
    og = _og()
    ids = np.asarray(list(prompt_ids), dtype=np.int32)
    forced = [int(t) for t in forced]
    params = search_options(model, len(ids) + len(forced) + 1)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out = [_last_logits(gen)]
    for t in forced:
        gen.append_tokens(np.asarray([t], dtype=np.int32))
        out.append(_last_logits(gen))
    return out


def _last_logits(gen) -> np.ndarray:
    x = np.asarray(gen.get_logits())
    return np.array(x.reshape(-1, x.shape[-1])[-1], dtype=np.float32)


def variant_dir(src: str, dst: str, config_update: dict | None = None, strip_value_info: bool = False) -> str:
    """Copy a genai model directory to ``dst`` (files copied, not linked: ORT refuses external
    data that resolves outside the model's directory), deep-merging ``config_update`` into
    genai_config.json; ``strip_value_info`` drops the graph's value_info (the model builder's
    fp16 graphs carry shapes that ORT's CPU EP rejects at the second step)."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    if config_update:
        path = os.path.join(dst, "genai_config.json")
        with open(path) as f:
            cfg = json.load(f)
        _merge(cfg, config_update)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=4)
    if strip_value_info:
        import onnx
        path = os.path.join(dst, "model.onnx")
        m = onnx.load(path, load_external_data=False)
        del m.graph.value_info[:]
        onnx.save(m, path)
    return dst


def _merge(base: dict, upd: dict) -> None:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def provider_options_entry(options: dict | None = None) -> dict:
    """The genai_config.json fragment selecting the MLX EP (model.decoder.session_options)."""
    return {"model": {"decoder": {"session_options": {
        "provider_options": [{EP_NAME: {str(k): str(v) for k, v in (options or {}).items()}}]}}}}


def main_report(reports: list):
    """The report of the decoder graph among ``reports`` (the last one ORT asked for)."""
    if not reports:
        raise RuntimeError("the MLX EP made no partition report: it was not asked for any graph")
    return reports[-1]
