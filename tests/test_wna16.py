"""GPTQ and AWQ checkpoints (W4A16 / W8A16): their formats, and a quantised model against transformers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_greedy_matches_hf, hf_greedy_reference, random_prompts, run_greedy

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.layers.wna16 import WNA16Linear, WNA16Spec, checkpoint_spec

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Every projection a GPTQ / AWQ quantiser takes: LINEARS (a MoE model's routed and shared experts' too) and
# Mixtral's experts (w1 / w3 / w2: gate, up, down); routers (mlp.gate, shared_expert_gate) stay 16-bit.
QUANTIZED = LINEARS + ("w1", "w3", "w2")
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's packer: nibble i of a word holds column order_map[i]
LOGITS_ATOL = 1e-4


# -- the formats, written here from their descriptions (AutoGPTQ, AutoAWQ), not from plait's code

def _rtn(weight: torch.Tensor, bits: int, group: int, sym: bool, g_idx: np.ndarray):
    """Round-to-nearest codes of a float weight [N, K] with one scale / zero per group of input rows (the
    rows of group g being those with g_idx == g): (codes [K, N] int64, scales [G, N] fp16, zeros [G, N])."""
    w = weight.double().numpy().T  # [K, N]
    k, n = w.shape
    top = 2**bits - 1
    groups = k // group
    scales, zeros = np.zeros((groups, n)), np.zeros((groups, n), dtype=np.int64)
    codes = np.zeros((k, n), dtype=np.int64)
    for g in range(groups):
        rows = np.nonzero(g_idx == g)[0]
        block = w[rows]
        if sym:
            s = np.float16(2 * np.abs(block).max(axis=0) / top).astype(np.float64)
            z = np.full(n, (top + 1) // 2)
        else:
            lo, hi = np.minimum(block.min(axis=0), 0), np.maximum(block.max(axis=0), 0)
            s = np.float16((hi - lo) / top).astype(np.float64)
            z = np.clip(np.round(-lo / s), 0, top).astype(np.int64)
        scales[g], zeros[g] = s, z
        codes[rows] = np.clip(np.round(block / s + z), 0, top)
    return codes, torch.tensor(scales, dtype=torch.float16), zeros


def _as_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _gptq_tensors(codes: np.ndarray, scales: torch.Tensor, zeros: np.ndarray, bits: int, g_idx: np.ndarray
                  ) -> dict[str, torch.Tensor]:
    """GPTQ's packing: qweight [K / pack, N] (row k at bits * (k % pack) of word k // pack), qzeros
    [G, N / pack] (column n at bits * (n % pack) of word n // pack), each zero stored less one."""
    pack = 32 // bits
    k, n = codes.shape
    qweight = np.zeros((k // pack, n), dtype=np.uint64)
    for j in range(pack):
        qweight |= codes[j::pack].astype(np.uint64) << np.uint64(bits * j)
    stored = (zeros - 1) & (2**bits - 1)
    qzeros = np.zeros((zeros.shape[0], n // pack), dtype=np.uint64)
    for j in range(pack):
        qzeros |= stored[:, j::pack].astype(np.uint64) << np.uint64(bits * j)
    return {"qweight": _as_int32(qweight), "qzeros": _as_int32(qzeros), "scales": scales,
            "g_idx": torch.tensor(g_idx, dtype=torch.int32)}


def _awq_tensors(codes: np.ndarray, scales: torch.Tensor, zeros: np.ndarray) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing: qweight [K, N / 8] and qzeros [G, N / 8], column col * 8 + order_map[i] at
    nibble i of word col; zeros stored as they are."""
    def pack(values: np.ndarray) -> torch.Tensor:
        words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint64)
        for i, column in enumerate(AWQ_ORDER_MAP):
            words |= values[:, column::8].astype(np.uint64) << np.uint64(4 * i)
        return _as_int32(words)

    return {"qweight": pack(codes), "qzeros": pack(zeros), "scales": scales}


def _dequantized(codes: np.ndarray, scales: torch.Tensor, zeros: np.ndarray, g_idx: np.ndarray
                 ) -> torch.Tensor:
    """weight[n, k] = (code[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n], fp32, [N, K]."""
    s = scales.double().numpy()[g_idx]
    return torch.tensor(((codes - zeros[g_idx]) * s).T, dtype=torch.float32).contiguous()


def _quantize(weight: torch.Tensor, method: str, bits: int, group: int, sym: bool, act_order: bool, seed: int
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A float weight [N, K] as a ``method`` checkpoint stores it, and the weight those tensors stand for;
    ``group`` -1: one group of all K rows (GPTQ's spelling)."""
    k = weight.shape[1]
    group = group if group > 0 else k
    g_idx = np.arange(k) // group
    if act_order:  # GPTQ's desc_act: rows quantised in another order, row perm[i] in group i // group
        perm = np.random.default_rng(seed).permutation(k)
        g_idx = np.empty(k, dtype=np.int64)
        g_idx[perm] = np.arange(k) // group
    codes, scales, zeros = _rtn(weight, bits, group, sym, g_idx)
    tensors = (_awq_tensors(codes, scales, zeros) if method == "awq"
               else _gptq_tensors(codes, scales, zeros, bits, g_idx))
    return tensors, _dequantized(codes, scales, zeros, g_idx)


def _quantization_config(method: str, bits: int, group: int, sym: bool, act_order: bool) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False}


def _quantized_checkpoint(src: Path, dst: Path, method: str, bits: int, group: int, sym: bool,
                          act_order: bool, left_16_bit: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """dst: src's checkpoint with every decoder projection (QUANTIZED: a MoE model's experts too) quantised as
    ``method`` writes it, but those whose names hold one of ``left_16_bit`` (an image model's vision side);
    returns the weights they stand for, by HF name (what transformers runs as the reference)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors, weights = {}, {}
    for name, t in sorted(load_file(src / "model.safetensors").items()):
        quantized = name.rsplit(".", 2)[-2] in QUANTIZED and not any(part in name for part in left_16_bit)
        if quantized and name.endswith(".weight"):
            # Projections of one input (q/k/v, gate/up) share GPTQ's act-order: it follows the input's.
            layer, projection = int(re.search(r"layers\.(\d+)\.", name)[1]), name.rsplit(".", 2)[-2]
            seed = 10 * layer + {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 1, "up_proj": 1}.get(
                projection, 2 + QUANTIZED.index(projection))
            packed, weights[name] = _quantize(t, method, bits, group, sym, act_order, seed)
            stem = name.removesuffix(".weight")
            tensors.update({f"{stem}.{key}": value for key, value in packed.items()})
        else:
            tensors[name] = t
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config(method, bits, group, sym, act_order)
    (dst / "config.json").write_text(json.dumps(cfg))
    return weights


# -- the layer ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,bits,sym,act_order", [("gptq", 4, True, False), ("gptq", 4, False, True),
                                                      ("gptq", 8, True, True), ("awq", 4, False, False)])
def test_a_layer_loads_each_format_to_the_weight_it_stands_for(method, bits, sym, act_order):
    """Shards of a fused layer (three projections' columns side by side) in GPTQ's or AWQ's packing: the
    layer's matmul is x times the weight those tensors stand for, act-order rows included."""
    g = torch.Generator().manual_seed(0)
    k, group, outs = 128, 32, (64, 32, 32)
    spec = WNA16Spec(method, bits, group, sym=sym, desc_act=act_order, zero_offset=int(method == "gptq"))
    layer = WNA16Linear(k, sum(outs), False, spec, torch.float32)
    want, start = [], 0
    for n in outs:
        tensors, weight = _quantize(torch.randn(n, k, generator=g), method, bits, group, sym, act_order,
                                    seed=0)  # one g_idx for the three: they share the input
        for name, tensor in tensors.items():
            layer.load_shard(name, start, n, tensor)
        want.append(weight)
        start += n
    layer.check_loaded()
    assert (layer.perm is not None) == act_order
    x = torch.randn(5, k, generator=g)
    torch.testing.assert_close(layer(x), x @ torch.cat(want).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,sym,stored_zero", [(4, False, None), (4, False, 15), (8, True, None)])
def test_a_slice_of_act_order_inputs_pads_its_uneven_groups(bits, sym, stored_zero):
    """A row-parallel rank's share of an act-order layer (as plait.parallel.shard cuts it: its rows of
    qweight and g_idx, every group's scales and zeros): its rows fill the groups unevenly, so each group's
    are padded to whole words (word_groups); the two ranks' outputs are the whole layer's on their inputs,
    and sum to it. stored_zero 15: every zero point GPTQ's 2^bits (its stored-less-one zero 0), which no code
    reaches, so the padding rows' weights are not 0 and only their zero inputs keep them out."""
    from plait.kernels import dispatch

    g = torch.Generator().manual_seed(bits)
    k, n, group, ranks = 128, 48, 32, 2
    spec = WNA16Spec("gptq", bits, group, sym=sym, desc_act=True, zero_offset=1)
    tensors, _ = _quantize(torch.randn(n, k, generator=g), "gptq", bits, group, sym, True, seed=bits)
    if stored_zero is not None:
        tensors["qzeros"] = torch.full_like(tensors["qzeros"], -1)  # every field all ones: 15
    whole = WNA16Linear(k, n, False, spec, torch.float32)
    for name, tensor in tensors.items():
        whole.load_shard(name, 0, n, tensor)
    whole.check_loaded()
    x = torch.randn(3, k, generator=g)
    local, words = k // ranks, k // ranks // spec.pack
    total = torch.zeros(3, n)
    for rank in range(ranks):
        inputs = slice(rank * local, (rank + 1) * local)
        layer = WNA16Linear(local, n, False, spec, torch.float32)
        sliced = {"qweight": tensors["qweight"][rank * words:(rank + 1) * words],
                  "g_idx": tensors["g_idx"][inputs], "qzeros": tensors["qzeros"], "scales": tensors["scales"]}
        for name, tensor in sliced.items():
            layer.load_shard(name, 0, n, tensor)
        layer.check_loaded()
        assert layer.word_groups is not None and layer.scales.shape[0] == k // group
        assert layer.codes.shape[0] == len(layer.word_groups) > words  # some group's rows padded
        on_slice = torch.zeros_like(x)
        on_slice[:, inputs] = x[:, inputs]
        out = layer(x[:, inputs])
        torch.testing.assert_close(out, whole(on_slice), rtol=1e-5, atol=1e-5)
        total += out
        # Through the kernels (the interpreter on CPU): the reference's function.
        x16 = x[:, inputs].to(torch.bfloat16)
        layer.compute_dtype = torch.bfloat16
        dispatch.set_cpu_interpreter(True)
        try:
            with torch.no_grad():  # (the kernels take no gradients)
                kernel_out = layer(x16)
        finally:
            dispatch.set_cpu_interpreter(False)
        torch.testing.assert_close(kernel_out.float(), layer(x16).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(total, whole(x), rtol=1e-5, atol=1e-4)


def test_fused_shards_with_different_act_orders_are_refused():
    spec = WNA16Spec("gptq", 4, 32, desc_act=True, zero_offset=1)
    layer = WNA16Linear(64, 64, False, spec, torch.float32)
    for seed, start in ((0, 0), (1, 32)):
        tensors, _ = _quantize(torch.randn(32, 64), "gptq", 4, 32, True, True, seed)
        if start:
            with pytest.raises(ValueError, match="different g_idx"):
                layer.load_shard("g_idx", start, 32, tensors["g_idx"])
        else:
            layer.load_shard("g_idx", start, 32, tensors["g_idx"])


def test_quantization_configs_are_read_or_refused_by_name():
    assert checkpoint_spec({"quantization_config": _quantization_config("gptq", 4, 128, True, False)}) == \
        WNA16Spec("gptq", 4, 128, sym=True, desc_act=False, zero_offset=1)
    assert checkpoint_spec({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                                    "zero_point": True, "version": "GEMM"}}) == \
        WNA16Spec("awq", 4, 64, sym=False)
    v2 = {"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"}
    assert checkpoint_spec({"quantization_config": v2}) == WNA16Spec("gptq", 4, 0, zero_offset=0)
    assert checkpoint_spec({}) is None
    assert checkpoint_spec({"quantization_config": {"quant_method": "fp8"}}) is None
    refused = {
        "version 'gemv'": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
        "3-bit": {"quant_method": "gptq", "bits": 3, "group_size": 128},
        "quantised lm_head": {"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True},
        "group_size 100": {"quant_method": "gptq", "bits": 4, "group_size": 100},
        "checkpoint_format 'marlin'": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                       "checkpoint_format": "marlin"},
        "zero_point false": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
    }
    for message, config in refused.items():
        with pytest.raises(ValueError, match=message):
            checkpoint_spec({"quantization_config": config})


def test_families_without_an_integer_path_are_refused_by_name():
    """Sparse MoE families load (their experts as integer FusedMoE stacks); the recurrent ones, whose Mamba
    projections load under names of their own, and experts of gpt-oss's kind (biases, the clamped SwiGLU:
    not in the integer kernels' epilogues) are refused by name."""
    from plait.layers.moe import SWIGLU_OAI, FusedMoE
    from plait.layers.wna16 import check_method

    spec = WNA16Spec("gptq", 4, 128, zero_offset=1)
    for architecture in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        check_method(spec, None, architecture)
    with pytest.raises(ValueError, match="GPTQ checkpoints of Mamba2ForCausalLM are not supported"):
        check_method(spec, None, "Mamba2ForCausalLM")
    experts = FusedMoE(4, 2, 128, 128, renormalize=True, activation=SWIGLU_OAI, bias=True)
    with pytest.raises(ValueError, match="integer experts with biases or the 'swiglu_oai' activation"):
        experts.use_integer(spec)


# -- a whole model against transformers

@pytest.mark.parametrize("family,method,bits,group,sym,act_order", [
    ("llama", "gptq", 4, 32, True, False),
    ("qwen2", "gptq", 4, 16, False, True),  # q/k/v biases, tied embeddings, act-order
    ("qwen3", "awq", 4, 32, False, False),  # q/k norms, head_dim apart from hidden / heads
    ("llama", "gptq", 8, -1, True, False),  # 8-bit, one group spanning each input
])
def test_a_quantized_checkpoint_matches_transformers_on_its_weights(tiny_models, tmp_path, family, method,
                                                                     bits, group, sym, act_order):
    """A GPTQ / AWQ checkpoint loads without --quantization and gives transformers' logits and greedy tokens
    for the model of the weights it stands for, prompts chunked and batched with decodes."""
    from transformers import AutoModelForCausalLM

    dst = tmp_path / f"{family}-{method}"
    weights = _quantized_checkpoint(tiny_models[family], dst, method, bits, group, sym, act_order)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, weight in weights.items():
            state[name].copy_(weight)
    engine = LLMEngine(EngineConfig(model=str(dst), max_num_batched_tokens=48, block_size=8))
    assert engine.runner.quantization == method
    assert_greedy_matches_hf(engine, hf, random_prompts(4, 1, 70, seed=3), 8, LOGITS_ATOL)


def test_mismatched_or_unsupported_quantization_is_refused(tiny_models, tmp_path):
    dst = tmp_path / "gptq"
    _quantized_checkpoint(tiny_models["llama"], dst, "gptq", 4, 32, True, False)
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* argument \(awq\)"):
        LLMEngine(EngineConfig(model=str(dst), quantization="awq"))
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* argument \(fp8\)"):
        LLMEngine(EngineConfig(model=str(dst), quantization="fp8"))
    engine = LLMEngine(EngineConfig(model=str(dst), quantization="gptq_marlin"))  # vLLM's kernel name: same
    assert engine.runner.quantization == "gptq"
    with pytest.raises(ValueError, match="--quantization awq serves a checkpoint quantised so"):
        LLMEngine(EngineConfig(model=str(tiny_models["llama"]), quantization="awq"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["q_proj"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="leaves part of the fused layer .*qkv_proj unquantised"):
        LLMEngine(EngineConfig(model=str(dst)))


def _rewrite(folder: Path, change) -> None:
    """The checkpoint in ``folder`` saved again after ``change`` (name -> tensor dict, edited in place)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_a_checkpoint_missing_a_shard_is_refused(tiny_models, tmp_path):
    dst = tmp_path / "awq"
    _quantized_checkpoint(tiny_models["llama"], dst, "awq", 4, 32, False, False)
    _rewrite(dst, lambda tensors: tensors.pop("model.layers.1.self_attn.k_proj.scales"))
    with pytest.raises(ValueError, match="without the scales of some columns"):
        LLMEngine(EngineConfig(model=str(dst)))


def test_modules_to_not_convert_stay_16_bit(tiny_models, tmp_path):
    """AWQ's modules_to_not_convert: those layers' checkpoint tensors are plain weights, loaded as such."""
    from safetensors.torch import load_file

    from plait.layers.linear import Linear

    dst = tmp_path / "awq"
    _quantized_checkpoint(tiny_models["llama"], dst, "awq", 4, 32, False, False)
    original = load_file(tiny_models["llama"] / "model.safetensors")

    def unquantize_down_proj(tensors: dict) -> None:
        for name in [n for n in tensors if ".layers.0.mlp.down_proj." in n]:
            del tensors[name]
        tensors["model.layers.0.mlp.down_proj.weight"] = original["model.layers.0.mlp.down_proj.weight"]

    _rewrite(dst, unquantize_down_proj)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["layers.0.mlp.down_proj"]
    (dst / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig(model=str(dst)))
    layers = engine.runner.model.model.layers
    assert isinstance(layers[0].mlp.down_proj, Linear) and isinstance(layers[1].mlp.down_proj, WNA16Linear)
    kept = original["model.layers.0.mlp.down_proj.weight"]
    torch.testing.assert_close(layers[0].mlp.down_proj.weight, kept)
    assert run_greedy(engine, random_prompts(2, 3, 9, seed=1), 4)[0]


def test_random_weights_of_a_quantized_config(tiny_models, tmp_path):
    """load_format dummy with a GPTQ config.json (what the GPU benchmarks run): every projection is a
    WNA16Linear holding the round-to-nearest codes of the 16-bit model's random draws, so the two random
    models are one model up to that rounding."""
    dst = tmp_path / "gptq-config"
    dst.mkdir()
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config("gptq", 4, 32, True, False)
    (dst / "config.json").write_text(json.dumps(cfg))
    quantized = LLMEngine(EngineConfig(model=str(dst), load_format="dummy"))
    plain = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), load_format="dummy"))
    got, want = quantized.runner.model, plain.runner.model
    layer = got.model.layers[1].self_attn.qkv_proj
    assert isinstance(layer, WNA16Linear)
    reference = want.model.layers[1].self_attn.qkv_proj.weight
    step = layer.scales.float().max()  # one quantisation step, at most, from the 16-bit draw
    assert 0 < (layer.dequantized(torch.float32) - reference).abs().max() <= step
    assert run_greedy(quantized, random_prompts(2, 3, 9, seed=1), 4)[0]


def test_lora_adapters_on_a_quantized_model_match_transformers(tiny_models, tmp_path):
    """--enable-lora on a GPTQ checkpoint (as vLLM serves adapters on quantised bases): each adapter's tokens
    and logits are transformers' on the dequantised weights with the adapter merged in; base rows beside
    adapters' rows stay the base model's."""
    from safetensors.torch import load_file, save_file
    from test_lora import _adapters, _lora_engine, _merged_hf

    folder = tiny_models["llama"]
    weights = _quantized_checkpoint(folder, tmp_path / "gptq", "gptq", 4, 32, True, False)
    dequantized = tmp_path / "dequantized"  # the HF checkpoint of the weights the GPTQ one stands for
    shutil.copytree(folder, dequantized)
    save_file(load_file(folder / "model.safetensors") | weights, dequantized / "model.safetensors")
    loras = _adapters(folder, tmp_path / "adapters")
    order = [loras["all"], None, loras["qv"], loras["mlp"]]
    prompts = random_prompts(len(order), 1, 70, seed=5)
    engine = _lora_engine(tmp_path / "gptq", max_num_batched_tokens=48, max_loras=2)
    assert isinstance(engine.runner.lora.layers["model.layers.0.self_attn.qkv_proj"].base, WNA16Linear)
    outs, logits = run_greedy(engine, prompts, 8, capture_logits=True, loras=order)
    for i, (prompt, lora) in enumerate(zip(prompts, order)):
        ref_ids, ref_logits = hf_greedy_reference(_merged_hf(dequantized, lora), prompt, outs[i], 8)
        assert outs[i] == ref_ids, f"prompt {i}: greedy tokens differ from transformers"
        torch.testing.assert_close(torch.stack(logits[i]), ref_logits, atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()


def _compressed_tensors_checkpoint(src: Path, dst: Path, bits: int, group: int, sym: bool
                                   ) -> dict[str, torch.Tensor]:
    """dst: src's checkpoint as llm-compressor saves a W4A16 / W8A16 model ("pack-quantized"), written by the
    compressed-tensors library itself, scales rounded to bf16 as the model's dtype stores them; returns the
    weights the library decompresses them to (in fp32 arithmetic), by HF name."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file, save_file

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym,
                            strategy="group" if group else "channel", group_size=group or None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors, weights = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.rsplit(".", 2)[-2] not in LINEARS or not name.endswith(".weight"):
            tensors[name] = t
            continue
        grouped = t.view(t.shape[0], -1, group or t.shape[1])  # [N, G, rows]
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        scale = scale.to(torch.bfloat16).float()
        packed = PackedQuantizationCompressor.compress({"weight": t, "weight_scale": scale,
                                                        "weight_zero_point": zero}, scheme)
        weights[name] = PackedQuantizationCompressor.decompress(packed, scheme)["weight"].contiguous()
        packed["weight_scale"] = packed["weight_scale"].to(torch.bfloat16)
        stem = name.removesuffix(".weight")
        tensors.update({f"{stem}.{key}": value for key, value in packed.items()})
    save_file(tensors, dst / "model.safetensors")
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                ignore=["lm_head"])
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = config.to_dict()
    (dst / "config.json").write_text(json.dumps(cfg))
    return weights


@pytest.mark.parametrize("family,bits,group,sym", [("llama", 4, 32, True), ("qwen2", 4, 16, False),
                                                   ("qwen3", 8, 0, True)])
def test_a_compressed_tensors_checkpoint_matches_transformers_on_its_weights(tiny_models, tmp_path, family,
                                                                             bits, group, sym):
    """llm-compressor's W4A16 / W8A16 ("pack-quantized", symmetric or not, per group or per channel), as the
    compressed-tensors library writes it: transformers' logits and greedy tokens on the weights the library
    decompresses it to."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "w4a16"
    weights = _compressed_tensors_checkpoint(tiny_models[family], dst, bits, group, sym)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, weight in weights.items():
            state[name].copy_(weight)
    engine = LLMEngine(EngineConfig(model=str(dst), max_num_batched_tokens=48, block_size=8,
                                    quantization="compressed-tensors"))
    assert engine.runner.quantization == "compressed-tensors"
    layer = engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, WNA16Linear) and layer.scales.dtype == torch.bfloat16
    assert_greedy_matches_hf(engine, hf, random_prompts(4, 1, 70, seed=4), 8, LOGITS_ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gpu_int4_engine_with_graphs_matches_the_torch_path(tmp_path, method):
    """bf16 on the GPU: a random GPTQ / AWQ model through the Triton GEMM (GEMV shape for decodes, tiles for
    prompts), CUDA graphs and overlapped steps gives the logits of the torch path (dequantised weights,
    torch_ref attention, eager, synchronous), up to rounding, until each output's first fork."""
    from test_fp8 import _embedding_led_engine, _logit_gaps, _random_llama

    from plait.kernels.dispatch import set_triton_enabled

    folder = Path(_random_llama(tmp_path))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config(method, 4, 128, True, False)
    (folder / "config.json").write_text(json.dumps(cfg))
    kw = dict(model=str(folder), load_format="dummy", seed=3, block_size=16, max_model_len=256,
              num_kv_blocks=256, dtype="bfloat16")

    def engine(**knobs) -> LLMEngine:
        return _embedding_led_engine(**{**kw, **knobs})

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2048, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 120, (12,), generator=g)]
    graphed = engine()
    assert graphed.runner.quantization == method
    got, got_logits = run_greedy(graphed, prompts, max_tokens=16, arrive_every=1, capture_logits=True)
    b = graphed.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    reference = engine(enforce_eager=True, async_scheduling=False, attention_backend="torch_ref")
    set_triton_enabled(False)  # every layer on its torch code: the dequantised weight through F.linear
    try:
        want, want_logits = run_greedy(reference, prompts, max_tokens=16, arrive_every=1, capture_logits=True)
    finally:
        set_triton_enabled(True)
    gaps = _logit_gaps(got, got_logits, want, want_logits)
    assert len(gaps) > 50 and max(gaps) < 0.05, f"largest logit gap {max(gaps):.3f} logit std"
