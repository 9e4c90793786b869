"""Pooler: a pooling model's embeddings, pooled from each prompt's hidden states chunk by chunk."""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from plait.config import PoolerConfig
from plait.engine.request import Request
from plait.engine.scheduler import StepPlan
from plait.pooling_params import SEQUENCE_TASK_OF, PoolingParams
from plait.runner.sampler import host_to_device

# sentence-transformers' module list (modules.json) and the module types plait reads from it.
SENTENCE_TRANSFORMERS_MODULES = "modules.json"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ST_DENSE = "sentence_transformers.models.Dense"
# A Dense module's activation_function (sentence-transformers writes the class's path; Tanh is its default).
ST_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
                        "torch.nn.modules.activation.Tanh": "tanh"}
ST_DENSE_DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"
# Where a Dense module keeps its weights (newer sentence-transformers, then older).
ST_DENSE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# A sentence-transformers Pooling config's modes, as plait's pooling types.
ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                    "pooling_mode_cls_token": "CLS"}
# What a decoder embedding model is trained for, and vLLM's default for one: the last token's hidden state,
# L2-normalised. Classifiers read the last token too (transformers' ...ForSequenceClassification).
DEFAULT_POOLING_TYPE = "LAST"
# A classifier's activation over its logits, by its config's problem_type, as transformers' losses read it
# (and vLLM): softmax for one label of several, a sigmoid per label where several may hold (or where there is
# a single label, a score), none for regression.
ACTIVATIONS = {"regression": "none", "multi_label_classification": "sigmoid"}


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers Dense module: activation(W x + b), its weights in ``path``."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "identity" or "tanh"


@dataclass(frozen=True)
class PoolingSpec:
    """A pooling model's pooler, resolved at start-up (resolve_pooling)."""

    pooling_type: str  # "LAST", "MEAN" or "CLS"
    normalize: bool  # the default of requests that leave PoolingParams.normalize unset
    hidden_size: int
    # "embed" (the pooled hidden state), or "classify" (a ...ForSequenceClassification model: its score head's
    # logits through ``activation``, one probability per label of ``labels``).
    task: str = "embed"
    activation: str = "none"  # "softmax", "sigmoid" or "none"
    labels: tuple[str, ...] = ()
    # Matryoshka models (config.json's is_matryoshka / matryoshka_dimensions) may be asked for shorter
    # embeddings; None: any dimensions up to hidden_size where is_matryoshka.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # sentence-transformers Dense modules after the pooling, in order: each a projection of the vector.
    dense: tuple[DenseSpec, ...] = ()

    @property
    def output_size(self) -> int:
        """An embedding's length before ``dimensions``: the last Dense module's, else the hidden size."""
        return self.dense[-1].out_features if self.dense else self.hidden_size

    @property
    def needs_every_position(self) -> bool:
        """Whether the pooled vector reads positions before the last: then no prompt token may be served
        from the prefix cache (a cached token's hidden state is never computed)."""
        return self.pooling_type != "LAST"

    def check(self, params: PoolingParams, model_name: str) -> None:
        """Refuse what this pooler cannot give (vLLM's words), before the request enters the engine."""
        if params.task is not None and SEQUENCE_TASK_OF[params.task] != self.task:
            kind = "an embedding" if self.task == "embed" else "a classification"
            raise ValueError(f'Model "{model_name}" is {kind} model: it does not support the {params.task} '
                             "task")
        d = params.dimensions
        if d is None:
            return
        if self.task != "embed":
            raise ValueError("dimensions applies to embeddings, not to a classifier's probabilities")
        if not self.is_matryoshka:
            raise ValueError(f'Model "{model_name}" does not support matryoshka representation, changing '
                             "output dimensions will lead to poor results.")
        if self.matryoshka_dimensions and d not in self.matryoshka_dimensions:
            raise ValueError(f'Model "{model_name}" only supports {list(self.matryoshka_dimensions)} '
                             "matryoshka dimensions, use other output dimensions will lead to poor results.")
        if d > self.output_size:
            raise ValueError(f"dimensions {d} is more than the model's embedding size {self.output_size}")


def resolve_pooling(config: PoolerConfig | None, model_path: Path, hf_config: dict, hidden_size: int,
                    classifier: bool = False, default_type: str | None = None) -> PoolingSpec:
    """The pooler of a model: ``config``'s fields where given, else the folder's sentence-transformers config
    (its Pooling module's mode, Normalize present or not), else the model's ``default_type`` (an encoder's:
    CLS, as vLLM's BERT models) or LAST, and normalised, as vLLM resolves it. A ``classifier`` (a score head)
    pools its ``default_type`` (an encoder's [CLS]) or LAST, unnormalised, its logits through its config's
    activation."""
    if classifier:
        return _classifier_pooling(config, hf_config, hidden_size, default_type)
    st_type, st_normalize, dense = _sentence_transformers_pooling(model_path, hidden_size)
    pooling_type = (config and config.pooling_type) or st_type or default_type or DEFAULT_POOLING_TYPE
    normalize = config.normalize if config is not None and config.normalize is not None else None
    if normalize is None:
        normalize = st_normalize if st_normalize is not None else True
    dims = hf_config.get("matryoshka_dimensions")
    return PoolingSpec(
        pooling_type=pooling_type,
        normalize=normalize,
        hidden_size=hidden_size,
        is_matryoshka=bool(hf_config.get("is_matryoshka")) or bool(dims),
        matryoshka_dimensions=tuple(dims) if dims else None,
        dense=dense,
    )


def _classifier_pooling(config: PoolerConfig | None, hf_config: dict, hidden_size: int,
                        default_type: str | None) -> PoolingSpec:
    from plait.models.llama import num_labels

    count = num_labels(hf_config)
    id2label = hf_config.get("id2label") or {}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    activation = ACTIVATIONS.get(hf_config.get("problem_type") or "", "sigmoid" if count < 2 else "softmax")
    pooling_type = (config and config.pooling_type) or default_type or DEFAULT_POOLING_TYPE
    return PoolingSpec(pooling_type=pooling_type, normalize=False,
                       hidden_size=hidden_size, task="classify", activation=activation, labels=labels)


def _sentence_transformers_pooling(model_path: Path, hidden_size: int
                                   ) -> tuple[str | None, bool | None, tuple[DenseSpec, ...]]:
    """(pooling type, normalize, Dense modules) from a sentence-transformers folder's modules.json; (None,
    None, ()) where the folder has none. Other modules that change the vector are refused by name."""
    modules_file = model_path / SENTENCE_TRANSFORMERS_MODULES if model_path.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return None, None, ()
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize, dense = None, False, []
    for module in modules:
        kind = module.get("type", "")
        if kind == ST_POOLING:
            pooling_type = _st_pooling_mode(model_path / module.get("path", ""))
        elif kind == ST_NORMALIZE:
            normalize = True
        elif kind == ST_DENSE:
            if normalize:
                raise ValueError(f"the model's sentence-transformers Dense module ({module.get('path')}) "
                                 "comes after its Normalize module; plait projects before normalising only")
            dense.append(_st_dense(model_path / module.get("path", ""),
                                   dense[-1].out_features if dense else hidden_size))
        elif kind != ST_TRANSFORMER:
            raise ValueError(f"the model's sentence-transformers module {kind!r} ({module.get('path')}) is "
                             "not supported: plait pools, projects (Dense) and normalises only")
    return pooling_type, normalize, tuple(dense)


def _st_dense(folder: Path, in_features: int) -> DenseSpec:
    config = json.loads((folder / "config.json").read_text())
    activation = config.get("activation_function", ST_DENSE_DEFAULT_ACTIVATION)
    if activation not in ST_DENSE_ACTIVATIONS:
        raise ValueError(f"the Dense module in {folder} uses {activation!r}; plait supports "
                         f"{sorted(ST_DENSE_ACTIVATIONS)}")
    if config.get("in_features") != in_features:
        raise ValueError(f"the Dense module in {folder} takes {config.get('in_features')} features, but the "
                         f"vector before it has {in_features}")
    return DenseSpec(folder, in_features, int(config["out_features"]), bool(config.get("bias", True)),
                     ST_DENSE_ACTIVATIONS[activation])


def _st_pooling_mode(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    modes = [kind for key, kind in ST_POOLING_MODES.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v
                    and k not in ST_POOLING_MODES)
    if others or len(modes) != 1:
        raise ValueError(f"the model's sentence-transformers pooling ({folder / 'config.json'}) sets "
                         f"{[k for k, v in config.items() if k.startswith('pooling_mode_') and v]}; plait "
                         "supports exactly one of lasttoken, mean_tokens or cls_token")
    return modes[0]


class Pooler:
    """Pools each pooling row of a step (every row, under the pooling runner): the last token's hidden state
    (LAST), the first's (CLS) or their mean (MEAN), in fp32; or, for a request of a per-token task
    (token_embed, token_classify), every prompt token's. A prompt that runs in several chunks keeps what its
    earlier chunks gave (a running sum, the first token's state, or the rows so far) until its last chunk, so
    an output does not depend on how the prompt was chunked; a first chunk (a preempted request's restart
    too) starts afresh."""

    def __init__(self, spec: PoolingSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        # The Dense modules' (weight [out, in], bias [out] or None, activation), fp32 on the device.
        self._dense = [_load_dense(d, torch.device(device)) for d in spec.dense]
        # A prompt's state between its chunks (MEAN: the sum so far; CLS: the first token's; a per-token task:
        # its rows so far, [n, hidden] each), dropped with the request (an aborted one's too).
        self._partial: weakref.WeakKeyDictionary[Request, torch.Tensor] = weakref.WeakKeyDictionary()
        self._token_rows: weakref.WeakKeyDictionary[Request, list[torch.Tensor]] = weakref.WeakKeyDictionary()

    def pool(self, plan: StepPlan, query_start_loc: np.ndarray, hidden: torch.Tensor
             ) -> tuple[list[Request], torch.Tensor, list[int]] | None:
        """The requests whose prompt ends in this step, their outputs' rows stacked [N, hidden] fp32 on the
        device (before dimensions and normalisation: finish()), and each request's row count (1, or its
        prompt's tokens for a per-token task); None where no prompt ends."""
        # hidden: [T, hidden] (a graph's padded rows after the real ones)
        per_token = [row.request.pooling_params is not None and row.request.pooling_params.per_token
                     for row in plan.rows]
        pool_rows = self._pool_mean if self.spec.pooling_type == "MEAN" else self._pool_one
        pooled = pool_rows(plan, query_start_loc, hidden, per_token) if not all(per_token) else None
        requests, parts = ([], []) if pooled is None else ([*pooled[0]], [pooled[1]])
        counts = [1] * len(requests)
        for i, row in enumerate(plan.rows):
            if not per_token[i]:
                continue
            rows = hidden[int(query_start_loc[i]) : int(query_start_loc[i + 1])].to(torch.float32, copy=True)
            kept = [rows] if row.start == 0 else [*self._token_rows.pop(row.request), rows]
            if row.start + row.num_new_tokens < row.request.num_prompt_tokens:
                self._token_rows[row.request] = kept
                continue
            requests.append(row.request)
            parts.append(torch.cat(kept))
            counts.append(row.request.num_prompt_tokens)
        return (requests, torch.cat(parts), counts) if requests else None

    def _pool_one(self, plan: StepPlan, query_start_loc: np.ndarray, hidden: torch.Tensor, skip: list[bool]
                  ) -> tuple[list[Request], torch.Tensor] | None:
        """LAST or CLS pooling of the rows not in ``skip``."""
        kind = self.spec.pooling_type
        done, index = [], []
        for i, row in enumerate(plan.rows):
            if skip[i]:
                continue
            first, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            ends_prompt = row.start + row.num_new_tokens == row.request.num_prompt_tokens
            if kind == "CLS" and row.start == 0 and not ends_prompt:
                self._partial[row.request] = hidden[first].to(torch.float32, copy=True)  # outlives hidden
            if ends_prompt:
                done.append(row)
                index.append(end - 1 if kind == "LAST" else first)
        if not done:
            return None
        vectors = hidden[host_to_device(index, torch.long, hidden.device)].float()
        if kind == "CLS":
            rows = [k for k, row in enumerate(done) if row.start > 0]
            if rows:  # the first token was in an earlier chunk
                vectors[rows] = torch.stack([self._partial.pop(done[k].request) for k in rows])
        return [row.request for row in done], vectors

    def _pool_mean(self, plan: StepPlan, query_start_loc: np.ndarray, hidden: torch.Tensor, skip: list[bool]
                   ) -> tuple[list[Request], torch.Tensor] | None:
        num_rows = len(plan.rows)
        lens = np.diff(query_start_loc[: num_rows + 1])
        row_of_token = host_to_device(np.repeat(np.arange(num_rows), lens), torch.long, hidden.device)
        sums = torch.zeros(num_rows, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, row_of_token, hidden[: int(lens.sum())].float())  # [R, hidden]
        done, vectors = [], []
        for i, row in enumerate(plan.rows):
            if skip[i]:
                continue
            total = sums[i] if row.start == 0 else self._partial.pop(row.request) + sums[i]
            if row.start + row.num_new_tokens == row.request.num_prompt_tokens:
                done.append(row.request)
                vectors.append(total / row.request.num_prompt_tokens)
            else:
                self._partial[row.request] = total
        return (done, torch.stack(vectors)) if done else None

    def project(self, vectors: torch.Tensor) -> torch.Tensor:
        """Pooled vectors [n, hidden] fp32 through the Dense modules, on their device: [n, output_size]."""
        for weight, bias, activation in self._dense:
            vectors = F.linear(vectors, weight, bias)
            if activation == "tanh":
                vectors = torch.tanh(vectors)
        return vectors

    def finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """A pooled vector as the request asked for it. An embedding [hidden]: its first ``dimensions``
        entries, then L2-normalised unless the request (or else the pooler) says not to. A classifier's
        logits [num_labels]: through its activation (probabilities). A per-token task's [tokens, ...]: each
        row so."""
        if self.spec.task == "classify":
            activation = self.spec.activation
            if activation == "softmax":
                return torch.softmax(vector, dim=-1)
            return torch.sigmoid(vector) if activation == "sigmoid" else vector
        if params.dimensions is not None:
            vector = vector[..., : params.dimensions]
        normalize = params.normalize if params.normalize is not None else self.spec.normalize
        return F.normalize(vector, p=2, dim=-1) if normalize else vector


def _load_dense(spec: DenseSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """A Dense module's weights (``linear.weight``, ``linear.bias``) from its folder, fp32 on ``device``."""
    path = next((spec.path / name for name in ST_DENSE_WEIGHT_FILES if (spec.path / name).is_file()), None)
    if path is None:
        names = " or ".join(ST_DENSE_WEIGHT_FILES)
        raise ValueError(f"the Dense module in {spec.path} has no weights ({names})")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(path)
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    weight = tensors["linear.weight"].to(device=device, dtype=torch.float32)
    if weight.shape != (spec.out_features, spec.in_features):
        raise ValueError(f"the Dense module in {spec.path} has a {tuple(weight.shape)} weight; its config "
                         f"says {(spec.out_features, spec.in_features)}")
    bias = tensors["linear.bias"].to(device=device, dtype=torch.float32) if spec.bias else None
    return weight, bias, spec.activation
