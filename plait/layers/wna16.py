"""Weight-only integer quantisation (W4A16 / W8A16): GPTQ and AWQ checkpoints, WNA16Linear, its reference."""

# GPTQ, AWQ and llm-compressor's W4A16 / W8A16 checkpoints (Qwen2.5-7B-Instruct-AWQ, Llama-3.1-8B-Instruct-
# GPTQ-INT4, RedHatAI's *-quantized.w4a16, ...) keep each linear weight as 4-bit or 8-bit integer codes with
# one scale and zero point per output column and group of ``group_size`` input rows; activations stay 16-bit.
# Whatever the checkpoint's packing, plait holds a layer as one layout, GPTQ's, which the kernels read:
#   codes:  [K // pack, N] int32, pack = 32 // bits: the code of weight (n, k) is bits ``bits * (k % pack)``
#           and up of word [k // pack, n] (unsigned);
#   scales: [K // G, N] in the checkpoint's dtype (fp16 for GPTQ / AWQ);
#   zeros:  [K // G, N] integers (uint8; int16 for 8 bits), already the zero point itself;
#   weight(n, k) = (code - zero[g, n]) * scale[g, n] with g = k // (K // G), computed in fp32.
# The formats differ only in packing (unpack_gptq_*, unpack_awq_*):
#   GPTQ: qweight [K / pack, N] packed along K (plait's own), qzeros [K / G, N / pack] packed along N, and
#         (checkpoint_format "gptq", the usual) each zero stored less one, as GPTQ-for-LLaMa wrote it;
#         "gptq_v2" stores the zero itself. With desc_act ("act-order") the rows are quantised in another
#         order and g_idx [K] names each input row's group: the loader sorts the rows by group
#         (WNA16Linear.perm) and each matmul gathers x's columns in that order. A row-parallel rank of such
#         a layer (tensor parallelism) holds a slice of the inputs, whose rows fall in any of the G groups,
#         unevenly: it keeps every group's scales and zeros, and its layer pads each group's sorted rows to
#         whole words (padding rows read a zero column of x) and reads each word row's group from
#         word_groups [K_padded // pack] int32 instead of k // (K // G) (WNA16Linear._pad_groups).
#   AWQ:  qweight [K, N / 8] and qzeros [K / G, N / 8] packed along N, the eight columns of a word in the
#         order AWQ_PACK_ORDER; scales as GPTQ's.
#   compressed-tensors "pack-quantized": weight_packed [N, K / pack] (GPTQ's words, transposed), codes signed
#         and stored plus 2^(bits - 1), so that zero point is implied where the scheme is symmetric; an
#         asymmetric one has weight_zero_point [N / pack, G] packed along N, stored the same way;
#         weight_scale [N, G]; weight_g_idx [K] under actorder.
# Off CUDA a layer runs its dequantised weight through torch (wna16_linear_ref), which is what the kernels
# (plait.kernels.wna16_gemm) are tested against.

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import DEEPSEEK_ARCHITECTURES
from plait.kernels.dispatch import use_triton
from plait.layers.linear import linear

# Bit widths the layouts and kernels take, and the methods a checkpoint may name.
SUPPORTED_BITS = (4, 8)
METHODS = ("gptq", "awq", "compressed-tensors")
# compressed-tensors' tensors of a packed layer, and its formats plait reads.
PACKED_FORMAT = "pack-quantized"
# GPTQ checkpoint formats: "gptq" stores each zero point less one (GPTQ_V1_ZERO_OFFSET), "gptq_v2" as it is.
GPTQ_FORMATS = ("gptq", "gptq_v2")
GPTQ_V1_ZERO_OFFSET = 1
# Where AWQ's packer puts column j of a group of eight: nibble i of a word holds column AWQ_PACK_ORDER[i].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
WORD_BITS = 32
# Dtype of the scales of random (dummy) weights, as GPTQ and AWQ write them.
DUMMY_SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class WNA16Spec:
    """How a checkpoint's integer layers are quantised (checkpoint_spec reads it from quantization_config)."""

    method: str  # "gptq" or "awq"
    bits: int  # 4 or 8 (AWQ: 4)
    group_size: int  # input rows per scale; 0 = one group spanning K (GPTQ's group_size -1)
    sym: bool = True  # zero points fixed at 2^(bits - 1): what random weights are quantised with
    desc_act: bool = False  # GPTQ act-order: rows carry their group in g_idx
    zero_offset: int = 0  # added to each stored zero point (GPTQ_V1_ZERO_OFFSET for GPTQ's own format)
    # Whether the checkpoint stores zero points (compressed-tensors' symmetric schemes imply 2^(bits - 1)).
    stored_zeros: bool = True

    @property
    def pack(self) -> int:
        return WORD_BITS // self.bits

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, in_features: int) -> int:
        return in_features // self.group_size if self.group_size else 1

    def group_rows(self, in_features: int) -> int:
        return self.group_size or in_features

    def zero_dtype(self) -> torch.dtype:
        return torch.uint8 if self.bits == 4 else torch.int16


def checkpoint_spec(hf_config: dict) -> WNA16Spec | None:
    """The WNA16Spec of a GPTQ or AWQ checkpoint's quantization_config; None for any other; a ValueError
    naming what plait does not load (another AWQ version, 3-bit codes, a quantised lm_head, ...)."""
    q = hf_config.get("quantization_config") or {}
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_spec(q)
    if method not in METHODS:
        return None
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size", 128))
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported: plait loads AWQ's 'gemm' packing")
        if bits != 4:
            raise ValueError(f"AWQ with {bits}-bit weights is not supported (4 bits only)")
        if not q.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point false) is not supported")
        spec = WNA16Spec("awq", 4, _group(group), sym=False)
    else:
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"GPTQ with {bits}-bit weights is not supported (bits {list(SUPPORTED_BITS)})")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (one of {list(GPTQ_FORMATS)})")
        if q.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantised lm_head are not supported")
        if q.get("dynamic"):
            raise ValueError("GPTQ checkpoints with per-module 'dynamic' overrides are not supported")
        spec = WNA16Spec("gptq", bits, _group(group), sym=bool(q.get("sym", True)),
                         desc_act=bool(q.get("desc_act", False)),
                         zero_offset=GPTQ_V1_ZERO_OFFSET if fmt == "gptq" else 0)
    return spec


def _compressed_tensors_spec(q: dict) -> WNA16Spec | None:
    """The spec of llm-compressor's weight-only integer schemes (W4A16, W8A16: "pack-quantized"); None where
    the checkpoint holds float weights (FP8, plait.layers.fp8) or quantises its activations too."""
    groups = list((q.get("config_groups") or {}).values())
    weights = [group.get("weights") or {} for group in groups]
    if not weights or any(w.get("type") != "int" for w in weights):
        return None
    if any(group.get("input_activations") for group in groups):
        raise ValueError("compressed-tensors checkpoints with integer weights and quantised activations "
                         "(W8A8, W4A8) are not supported: plait loads weight-only ones (W4A16, W8A16)")
    if len({str(sorted(w.items())) for w in weights}) > 1:
        raise ValueError("compressed-tensors config_groups with different weight schemes are not supported")
    w = weights[0]
    fmt = groups[0].get("format") or q.get("format")
    if fmt != PACKED_FORMAT:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported for integer weights "
                         f"({PACKED_FORMAT!r} is)")
    if w.get("num_bits") not in SUPPORTED_BITS:
        raise ValueError(f"compressed-tensors {w.get('num_bits')}-bit weights are not supported "
                         f"(bits {list(SUPPORTED_BITS)})")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported (group, channel)")
    sym = bool(w.get("symmetric", True))
    return WNA16Spec("compressed-tensors", w["num_bits"], _group(w.get("group_size")) if strategy == "group"
                     else 0, sym=sym, desc_act=w.get("actorder") not in (None, False, "static"),
                     stored_zeros=not sym)


def _group(group_size: int) -> int:
    if group_size == -1:
        return 0
    if not isinstance(group_size, int) or group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"quantization group_size {group_size}: plait takes -1 or a power of two >= 16")
    return group_size


def unquantized_modules(hf_config: dict) -> list[str]:
    """The layers the checkpoint leaves in 16 bits: AWQ's modules_to_not_convert (parts of names) or
    compressed-tensors' ignore (names, or "re:" and a regular expression)."""
    q = hf_config.get("quantization_config") or {}
    return list(q.get("modules_to_not_convert") or q.get("ignore") or [])


# -- packing -------------------------------------------------------------------------------------------------

def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, WORD_BITS, bits, dtype=torch.int32, device=device)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [K, N] (0 .. 2^bits - 1) packed along K: [K // pack, N] int32, plait's (GPTQ's) layout."""
    k, n = codes.shape
    pack = WORD_BITS // bits
    shifts = _shifts(bits, codes.device).to(torch.int64)[:, None]
    parts = codes.to(torch.int64).view(k // pack, pack, n) << shifts
    words = parts.sum(dim=1)  # disjoint bit ranges: the sum is the OR
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as the signed int32 of those 32 bits


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[K // pack, N] int32 packed along K -> codes [K, N] int32."""
    rows, n = words.shape
    codes = (words[:, None, :] >> _shifts(bits, words.device)[:, None]) & ((1 << bits) - 1)
    return codes.reshape(rows * (WORD_BITS // bits), n)


def unpack_columns(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, N // pack] int32 packed along N -> [R, N] int32; ``order``: the column each position of a word
    holds (AWQ_PACK_ORDER), else in sequence."""
    rows, cols = words.shape
    pack = WORD_BITS // bits
    codes = (words[:, :, None] >> _shifts(bits, words.device)) & ((1 << bits) - 1)  # [R, cols, pack]
    if order is not None:
        codes = codes[:, :, torch.argsort(torch.tensor(order, device=words.device))]
    return codes.reshape(rows, cols * pack)


def pack_columns(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """unpack_columns' inverse: [R, N] codes -> [R, N // pack] int32."""
    rows, n = codes.shape
    pack = WORD_BITS // bits
    grouped = codes.to(torch.int64).view(rows, n // pack, pack)
    if order is not None:
        grouped = grouped[:, :, list(order)]
    words = (grouped << _shifts(bits, codes.device).to(torch.int64)).sum(dim=2)
    return (words - ((words >> 31) << 32)).to(torch.int32)


# -- the arithmetic ------------------------------------------------------------------------------------------

def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               dtype: torch.dtype, word_groups: torch.Tensor | None = None) -> torch.Tensor:
    """The weight, [N, K] in ``dtype``, that plait-layout codes, scales and zeros stand for: (code - zero) *
    scale in fp32, rounded once. ``word_groups``: each word row's group (uneven groups), else row k's group
    is k // (K // G)."""
    # codes: [K // pack, N] int32; scales, zeros: [groups, N]; word_groups: [K // pack] -> [N, K]
    q = unpack_rows(codes, bits)  # [K, N]
    if word_groups is not None:
        row_groups = word_groups.long().repeat_interleave(WORD_BITS // bits)  # [K]
        z, s = zeros.to(torch.int32)[row_groups], scales.float()[row_groups]
    else:
        group_rows = q.shape[0] // scales.shape[0]
        z = zeros.to(torch.int32).repeat_interleave(group_rows, dim=0)
        s = scales.float().repeat_interleave(group_rows, dim=0)
    return ((q - z).float() * s).t().to(dtype)


def sorted_inputs(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x's columns in the order of act-order's sorted rows: [..., K] -> [..., len(perm)]. A perm longer than
    K holds padding rows (groups padded to whole words, WNA16Linear._pad_groups), whose entries are K: they
    read a zero column appended to x, so they add exact zeros whatever x holds (inf and NaN too)."""
    if perm.shape[0] > x.shape[-1]:
        x = F.pad(x, (0, 1))
    return x.index_select(-1, perm)


def wna16_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                     dequantized: torch.Tensor | None = None, exact_weights: bool = False,
                     word_groups: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with the weight dequantised to x's dtype, as torch's matmul computes it
    (``exact_weights``: in fp32, unrounded, the sum rounded once to x's dtype: what the one-row kernel
    computes); ``perm``: the input order of the rows (act-order), applied to x's columns (sorted_inputs);
    ``dequantized``: the weight in x's dtype, where the caller keeps it; ``word_groups``: as dequantize's."""
    # x: [..., K] -> [..., N]
    if perm is not None:
        x = sorted_inputs(x, perm)
    if exact_weights:
        weight = dequantize(codes, scales, zeros, bits, torch.float32, word_groups)
        return linear(x.float(), weight, bias.float() if bias is not None else None).to(x.dtype)
    if dequantized is None:
        dequantized = dequantize(codes, scales, zeros, bits, x.dtype, word_groups)
    return linear(x, dequantized, bias)


def quantize_rtn(weight: torch.Tensor, spec: WNA16Spec, scale_dtype: torch.dtype = DUMMY_SCALE_DTYPE
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantisation of a float weight [N, K] as ``spec`` lays it out (what random weights are
    given): (codes [K, N] int32, unpacked; scales [groups, N]; zeros [groups, N]). Symmetric, as GPTQ's sym:
    zero 2^(bits - 1), scale 2 * amax / (2^bits - 1); else the group's range (with 0) over 2^bits - 1."""
    n, k = weight.shape
    rows = spec.group_rows(k)
    w = weight.float().t().reshape(k // rows, rows, n)  # [groups, rows, N]
    top = spec.max_code
    if spec.sym:
        amax = w.abs().amax(dim=1)
        scales = _scale_floor((2 * amax / top).to(scale_dtype))
        zeros = torch.full_like(amax, (top + 1) // 2)
    else:
        lo, hi = w.amin(dim=1).clamp(max=0.0), w.amax(dim=1).clamp(min=0.0)
        scales = _scale_floor(((hi - lo) / top).to(scale_dtype))
        zeros = torch.round(-lo / scales.float()).clamp(0, top)
    q = torch.round(w / scales.float()[:, None, :] + zeros[:, None, :]).clamp(0, top)
    return q.reshape(k, n).to(torch.int32), scales, zeros.to(torch.int32)


# compressed-tensors' names -> GPTQ's, whose layout they have once transposed (weight_shape is only checked).
COMPRESSED_TENSORS_NAMES = {"weight_packed": "qweight", "weight_zero_point": "qzeros",
                            "weight_scale": "scales", "weight_g_idx": "g_idx", "weight_shape": "weight_shape"}


def projection_tensor(spec: WNA16Spec, name: str, tensor: torch.Tensor, in_features: int, out_features: int,
                      groups: int | None = None) -> tuple[str, torch.Tensor]:
    """One checkpoint tensor of a projection (out_features x in_features: a routed expert's, which FusedMoE
    stacks, or a WNA16Linear's columns) unpacked from the checkpoint's format into plait's layout: ("codes",
    [K // pack, N] int32), ("zeros", [G, N] int32 zero points), ("scales", [G, N] in the checkpoint's dtype),
    ("g_idx", [K] int64) or ("weight_shape", as stored, checked here). ``groups``: G, checked; None: as many
    as the tensor holds (an act-order rank's layer takes every group's: WNA16Linear._hold_groups)."""
    k, n = in_features, out_features

    def expect_grouped(t: torch.Tensor, columns: int, what: str) -> None:  # t: [G, columns]
        _expect(t, (t.shape[0] if groups is None else groups, columns), what)
    if spec.method == "compressed-tensors" and name in COMPRESSED_TENSORS_NAMES:
        if name == "weight_shape":
            _expect(tensor, (2,), name)
            if tensor.tolist() != [n, k]:
                raise ValueError(f"weight_shape {tensor.tolist()} of a projection of {n} x {k}")
            return "weight_shape", tensor
        if name in ("weight_packed", "weight_zero_point", "weight_scale"):
            tensor = tensor.t()  # [N, ...] -> GPTQ's [..., N]
        name = COMPRESSED_TENSORS_NAMES[name]
    if name == "qweight":
        if spec.method == "awq":
            _expect(tensor, (k, n // spec.pack), "qweight")
            return "codes", pack_rows(unpack_columns(tensor.to(torch.int32), spec.bits, AWQ_PACK_ORDER),
                                      spec.bits)
        _expect(tensor, (k // spec.pack, n), "qweight")
        return "codes", tensor.to(torch.int32).contiguous()
    if name == "qzeros":
        if not spec.stored_zeros:
            raise ValueError("zero points in a checkpoint whose scheme is symmetric")
        expect_grouped(tensor, n // spec.pack, "qzeros")
        order = AWQ_PACK_ORDER if spec.method == "awq" else None
        return "zeros", unpack_columns(tensor.to(torch.int32), spec.bits, order) + spec.zero_offset
    if name == "scales":
        expect_grouped(tensor, n, "scales")
        return "scales", tensor
    if name == "g_idx":
        _expect(tensor, (k,), "g_idx")
        return "g_idx", tensor.to(torch.int64)
    raise ValueError(f"a {spec.method.upper()} projection has no tensor {name!r}")


def in_group_order(g_idx: torch.Tensor, spec: WNA16Spec) -> bool:
    """Whether g_idx [K] puts every input row in its own place's group (what a checkpoint without act-order
    writes, desc_act false), so that the rows need no sorting."""
    k = g_idx.shape[0]
    return torch.equal(g_idx, torch.arange(k, device=g_idx.device) // spec.group_rows(k))


def _scale_floor(scales: torch.Tensor) -> torch.Tensor:
    """Scales of all-zero groups raised to the dtype's smallest normal number, so no code divides by zero."""
    return scales.clamp_min(torch.finfo(scales.dtype).tiny)


# -- the layer -----------------------------------------------------------------------------------------------

class WNA16Linear(nn.Module):
    """A linear layer of integer codes with group scales and zero points (plait's layout, above), with
    plait.layers.linear.Linear's interface. The checkpoint's pieces arrive through load_shard, one HF
    projection (a column range of a fused layer) at a time."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: WNA16Spec,
                 compute_dtype: torch.dtype, device: torch.device | str | None = None,
                 scale_dtype: torch.dtype = DUMMY_SCALE_DTYPE) -> None:
        super().__init__()
        rows = spec.group_rows(in_features)
        if in_features % rows or rows % spec.pack:
            raise ValueError(f"a layer of {in_features} inputs does not split into {rows}-row groups of "
                             f"{spec.pack} codes a word")
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.compute_dtype = compute_dtype  # the model's dtype: what x and the output are
        groups = spec.groups(in_features)
        self.codes = nn.Parameter(torch.zeros(in_features // spec.pack, out_features, dtype=torch.int32,
                                              device=device), requires_grad=False)  # [K // pack, N]
        self.scales = nn.Parameter(torch.full((groups, out_features), float("nan"), dtype=scale_dtype,
                                              device=device), requires_grad=False)  # [groups, N]
        zeros = torch.full((groups, out_features), 1 << (spec.bits - 1), dtype=spec.zero_dtype(),
                           device=device)  # [groups, N]; the implied zero point until the checkpoint's
        if spec.stored_zeros:
            self.zeros = nn.Parameter(zeros, requires_grad=False)
        else:
            self.register_buffer("zeros", zeros)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device),
                                  requires_grad=False) if bias else None)
        # Act-order: the checkpoint's g_idx (kept until check_loaded sorts the rows by it), then the input
        # order of the sorted rows, which x's columns are gathered in.
        self._g_idx: torch.Tensor | None = None
        self.register_buffer("perm", None)
        # Uneven groups (_pad_groups): each word row's group, [K_padded // pack] int32; None: k // group_rows.
        self.register_buffer("word_groups", None)
        self._reference_weight: torch.Tensor | None = None  # off CUDA: the dequantised weight, made once

    @classmethod
    def from_linear(cls, layer: nn.Linear, spec: WNA16Spec,
                    device: torch.device | None = None) -> WNA16Linear:
        """An empty layer of ``layer``'s shape on ``device``, for the checkpoint (or random weights)."""
        n, k = layer.weight.shape
        return cls(k, n, layer.bias is not None, spec, layer.weight.dtype, device)

    # -- loading -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_shard(self, name: str, start: int, num_out: int, tensor: torch.Tensor) -> str:
        """One checkpoint tensor (GPTQ's and AWQ's ``qweight``, ``qzeros``, ``scales``, ``g_idx``; compressed-
        tensors' ``weight_packed``, ``weight_zero_point``, ``weight_scale``, ``weight_g_idx``,
        ``weight_shape``) of output columns ``start:start + num_out``, unpacked from the checkpoint's format;
        returns the parameter it filled."""
        cols = slice(start, start + num_out)
        kind, value = projection_tensor(self.spec, name, tensor, self.in_features, num_out, groups=None)
        if kind == "codes":  # value: [K // pack, n]
            self.codes[:, cols] = value
        elif kind in ("zeros", "scales"):  # value: [G, n]
            self._hold_groups(value.shape[0])
            _expect(value, (self.scales.shape[0], num_out), name)
            if kind == "zeros":
                self.zeros[:, cols] = value.to(self.zeros.dtype)
            else:
                if value.dtype != self.scales.dtype and torch.isnan(self.scales).all():
                    self.scales.data = self.scales.data.to(value.dtype)  # keep the checkpoint's precision
                self.scales[:, cols] = value.to(self.scales.dtype)
        elif kind == "g_idx":
            g_idx = value.to(self.codes.device)
            if self._g_idx is not None and not torch.equal(self._g_idx, g_idx):
                raise ValueError("the projections fused into one layer have different g_idx (act-order)")
            self._g_idx = g_idx
        return kind

    def _hold_groups(self, groups: int) -> None:
        """Act-order: a row-parallel rank's slice of the inputs (plait.parallel.shard) keeps every group's
        scales and zeros, since its rows fall in any group; the layer takes their count from the first that
        arrives (shapes are checked as usual after)."""
        if not self.spec.desc_act or groups == self.scales.shape[0] or not torch.isnan(self.scales).all():
            return
        n, device = self.out_features, self.scales.device
        self.scales.data = torch.full((groups, n), float("nan"), dtype=self.scales.dtype, device=device)
        self.zeros.data = torch.full((groups, n), 1 << (self.spec.bits - 1), dtype=self.zeros.dtype,
                                     device=device)

    @torch.no_grad()
    def load_weight_rows(self, start: int, rows: torch.Tensor) -> None:
        """Float rows ``start:start + len(rows)`` (random weights) quantised round-to-nearest here."""
        # rows: [n, in_features]
        codes, scales, zeros = quantize_rtn(rows, self.spec, self.scales.dtype)
        cols = slice(start, start + rows.shape[0])
        self.codes[:, cols] = pack_rows(codes, self.spec.bits)
        self.scales[:, cols] = scales
        self.zeros[:, cols] = zeros.to(self.zeros.dtype)

    @torch.no_grad()
    def check_loaded(self) -> None:
        """Every column has its scales; act-order rows sorted by group (perm): in even groups of group_size
        rows where they are (one device; a rank's slice of the inputs whose groups it holds whole), else
        padded to whole words a group (_pad_groups)."""
        self._reference_weight = None  # made again from what was loaded
        if torch.isnan(self.scales.float()).any():
            raise ValueError(f"a {self.spec.method.upper()} layer came without the scales of some columns")
        g_idx, self._g_idx = self._g_idx, None
        k, groups = self.in_features, self.scales.shape[0]
        even = torch.arange(k, device=self.codes.device) // self.spec.group_rows(k)  # [K]: even groups' ids
        if g_idx is None:
            if groups != self.spec.groups(k):
                raise ValueError(f"a layer of {k} inputs holding {groups} groups came without g_idx")
            return
        # Groups first .. first + K // group_rows, filled evenly, are the usual layout (a rank's slice of the
        # inputs may start past group 0 where its groups are whole).
        first = int(g_idx.min())
        if first < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"g_idx names groups outside the {groups} the scales hold")
        fits = groups >= self.spec.groups(k) + first
        if fits and torch.equal(g_idx, even + first):
            self._keep_groups(first)
            return  # rows already in group order (the trivial g_idx desc_act false writes)
        perm = torch.argsort(g_idx, stable=True)  # [K]
        codes = unpack_rows(self.codes.data, self.spec.bits)[perm]  # [K, N], rows in group order
        if fits and torch.equal(g_idx[perm], even + first):
            self._keep_groups(first)
            self.codes.data = pack_rows(codes, self.spec.bits)
            self.perm = perm
            return
        self._pad_groups(g_idx[perm], perm, codes)

    def _keep_groups(self, first: int) -> None:
        """Only the scales and zeros of groups first .. first + K // group_rows, which this layer's rows
        fill evenly (a rank's slice of the inputs that holds whole groups: act-order's static groups)."""
        count = self.spec.groups(self.in_features)
        if first or count != self.scales.shape[0]:
            self.scales.data = self.scales.data[first:first + count].clone()
            self.zeros.data = self.zeros.data[first:first + count].clone()

    def _pad_groups(self, row_groups: torch.Tensor, perm: torch.Tensor, codes: torch.Tensor) -> None:
        """Rows sorted into uneven groups (act-order, a row-parallel rank's slice of the inputs): each group's
        rows padded to whole words, since a word's codes share one scale and zero. A padding row's perm entry
        is K (sorted_inputs reads a zero column there); its code is the zero point where the codes reach it
        (weight 0), else the top code (weight -scale: GPTQ's stored-less-one zero 0 reads 2^bits): finite,
        so its product with the zero input is exactly 0. Each word row's group goes in word_groups."""
        # row_groups: [K] the sorted rows' groups; perm: [K] their inputs; codes: [K, N] sorted
        spec, k = self.spec, self.in_features
        device = codes.device
        counts = torch.bincount(row_groups, minlength=self.scales.shape[0])  # [G] rows a group
        padded = (counts + spec.pack - 1) // spec.pack * spec.pack  # [G] rows a group, whole words
        padded_groups = torch.repeat_interleave(torch.arange(len(padded), device=device), padded)  # [K_pad]
        # Sorted row i lands at its group's padded start plus its place within its group.
        starts, padded_starts = torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0) - padded  # [G]
        place = padded_starts[row_groups] + torch.arange(k, device=device) - starts[row_groups]  # [K]
        filled = self.zeros.data.to(torch.int32).clamp(max=spec.max_code)[padded_groups]  # [K_pad, N]
        filled[place] = codes
        padded_perm = torch.full((len(padded_groups),), k, dtype=perm.dtype, device=device)  # [K_pad]
        padded_perm[place] = perm
        self.codes.data = pack_rows(filled, spec.bits)  # [K_pad // pack, N]
        self.perm = padded_perm
        self.word_groups = padded_groups[::spec.pack].to(torch.int32)  # [K_pad // pack]

    # -- running -----------------------------------------------------------------------------------------

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in ``dtype``, its columns in the input order of the sorted rows (perm; [N,
        K_padded] where _pad_groups padded them)."""
        return dequantize(self.codes, self.scales, self.zeros, self.spec.bits, dtype, self.word_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if x.dtype in (torch.bfloat16, torch.float16) and use_triton(x):
            from plait.kernels.wna16_gemm import wna16_linear

            if self.perm is not None:
                x = sorted_inputs(x, self.perm)
            return wna16_linear(x, self.codes, self.scales, self.zeros, self.spec.bits, self.bias,
                                word_groups=self.word_groups)
        if self._reference_weight is None or self._reference_weight.dtype != x.dtype:
            self._reference_weight = self.dequantized(x.dtype)
        return wna16_linear_ref(x, self.codes, self.scales, self.zeros, self.spec.bits, self.bias, self.perm,
                                self._reference_weight, word_groups=self.word_groups)

    # The fused decode paths of plait.layers.linear.Linear are 16-bit-weight kernels: the model takes its
    # plain path (a norm launch of its own, gate/up then silu-and-mul).
    def adds_residual(self, x: torch.Tensor) -> bool:
        return False

    def fuses_gate_up_silu(self, x: torch.Tensor) -> bool:
        return False

    def fold_norm_weight(self, norm_weight: torch.Tensor) -> None:
        raise RuntimeError("a quantised layer's weight cannot take a norm's weight")

    @property
    def weight(self) -> torch.Tensor:
        """The codes: what LoRA wrappers read the layer's device from (the dtype is compute_dtype)."""
        return self.codes

    def extra_repr(self) -> str:
        rows = self.spec.group_rows(self.in_features)
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.method} "
                f"{self.spec.bits}-bit, groups of {rows}" + (", act-order" if self.perm is not None else "")
                + (", uneven groups padded to whole words" if self.word_groups is not None else ""))


def _expect(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} of shape {tuple(tensor.shape)}, expected {shape}")


# Families whose GPTQ / AWQ checkpoints plait refuses by name: the recurrent models (their Mamba projections
# load under names of their own) and Granite MoE (its experts are stacked tensors, input_linear /
# output_linear, which no integer checkpoint layout plait reads packs). Sparse MoE families (Mixtral,
# Qwen2-MoE, Qwen3-MoE) load: their routed experts are integer FusedMoE stacks (FusedMoE.use_integer), the
# rest WNA16Linear layers. DeepSeek-V2 / V3 (MLA) too: no integer checkpoint of theirs has been checked
# (its kv_b_proj, read only through the absorbed matrices, would be dequantised as an FP8 one is).
REFUSED_ARCHITECTURES = frozenset({"Mamba2ForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM",
                                   "GraniteMoeHybridForCausalLM", "GraniteMoeForCausalLM",
                                   "GraniteMoeSharedForCausalLM", *DEEPSEEK_ARCHITECTURES})


def check_method(spec: WNA16Spec, flag: str | None, architecture: str) -> None:
    """A ValueError where ``--quantization`` names another method than the checkpoint's (vLLM's message), or
    the model family has no integer-weight path."""
    if flag is not None and flag not in (spec.method, f"{spec.method}_marlin"):
        raise ValueError(f"Quantization method specified in the model config ({spec.method}) does not match "
                         f"the quantization method specified in the `quantization` argument ({flag}).")
    if architecture in REFUSED_ARCHITECTURES:
        raise ValueError(f"{spec.method.upper()} checkpoints of {architecture} are not supported")


# Layers a GPTQ / AWQ checkpoint leaves in 16 bits whatever it says: the lm_head (tied to the embedding in
# some models; GPTQ's lm_head flag is refused above).
SKIPPED_LAYERS = ("lm_head",)
# A MoE block's router and Qwen2-MoE's shared-expert gate (one output column: nothing to pack along N), which
# GPTQ / AWQ quantisers leave in 16 bits whether or not modules_to_not_convert / ignore lists them (they
# quantise the projections of the attention and of the experts: GPTQModel's and AutoAWQ's Mixtral and
# Qwen-MoE definitions), as vLLM builds them unquantised.
ROUTER_LAYERS = ("gate", "shared_expert_gate")
# plait's fused layers -> the HF projections they hold, for modules_to_not_convert's names.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _left_unquantized(name: str, unquantized: list[str]) -> bool:
    """Whether modules_to_not_convert covers layer ``name`` (transformers' rule: an entry is part of the
    name); a fused layer only some of whose projections it covers is a ValueError."""
    stem, _, leaf = name.rpartition(".")
    hf_names = [f"{stem}.{part}" for part in FUSED_PARTS.get(leaf, (leaf,))]
    covered = [any(re.fullmatch(key[3:], hf) if key.startswith("re:") else key in hf for key in unquantized)
               for hf in hf_names]
    if any(covered) and not all(covered):
        raise ValueError(f"modules_to_not_convert leaves part of the fused layer {name} unquantised")
    return all(covered)


@torch.no_grad()
def quantize_model(model: nn.Module, spec: WNA16Spec, device: torch.device | None = None,
                   unquantized: list[str] = (), left_16_bit: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear of ``model`` but the lm_head, MoE routers (ROUTER_LAYERS), the checkpoint's
    modules_to_not_convert and those under ``left_16_bit`` (module name prefixes: an image model's vision
    side) with an empty WNA16Linear on ``device`` for the checkpoint to fill, and make every MoE block's
    routed experts integer stacks (FusedMoE.use_integer), from outside the model (its code is unchanged);
    16-bit layers left on the meta device (deferred_weights) get memory there. Returns how many linear
    layers were replaced."""
    for module in model.modules():
        if hasattr(module, "use_integer"):  # FusedMoE (not imported here: plait.layers.moe imports this)
            module.use_integer(spec, device)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    count = 0
    for name, module in linears:
        if (name.rsplit(".", 1)[-1] in SKIPPED_LAYERS or _is_router(model, name)
                or name.startswith(left_16_bit) or _left_unquantized(name, list(unquantized))):
            if module.weight.is_meta:
                module.to_empty(device=device)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, WNA16Linear.from_linear(module, spec, device))
        count += 1
    return count


def _is_router(model: nn.Module, name: str) -> bool:
    """Whether layer ``name`` is a MoE block's router or shared-expert gate (ROUTER_LAYERS beside experts)."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return leaf in ROUTER_LAYERS and hasattr(getattr(parent, "experts", None), "use_integer")
